"""``deepspeed.runtime.activation_checkpointing``."""

from zerodist.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
