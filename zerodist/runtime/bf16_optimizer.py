"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer``, which no zerodist optimizer is
(zerodist/engine/deepspeed_optimizers.py)."""

from zerodist.engine.deepspeed_optimizers import BF16_Optimizer

__all__ = ["BF16_Optimizer"]
