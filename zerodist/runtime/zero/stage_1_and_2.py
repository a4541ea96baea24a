"""``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer`` for ``isinstance``
(zerodist/engine/deepspeed_optimizers.py)."""

from zerodist.engine.deepspeed_optimizers import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
