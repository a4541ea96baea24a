"""``deepspeed.runtime.base_optimizer``: ``ZeROOptimizer`` for ``isinstance`` (zerodist/engine/deepspeed_optimizers.py)."""

from zerodist.engine.deepspeed_optimizers import ZeROOptimizer

__all__ = ["ZeROOptimizer"]
