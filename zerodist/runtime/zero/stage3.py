"""``deepspeed.runtime.zero.stage3``: ``DeepSpeedZeroOptimizer_Stage3`` for ``isinstance``
(zerodist/engine/deepspeed_optimizers.py)."""

from zerodist.engine.deepspeed_optimizers import DeepSpeedZeroOptimizer_Stage3

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
