"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is zerodist's ``Engine`` (for ``isinstance``)."""

from zerodist.engine import Engine

DeepSpeedEngine = Engine

__all__ = ["DeepSpeedEngine"]
