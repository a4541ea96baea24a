"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (``deepspeed.checkpointing``): the path
DeepSpeed's scripts and tests import; the API lives in zerodist/pipe/checkpointing.py, where the
pipeline's ``PipelineModule`` (layer 5) reaches it without importing this facade (layer 8)."""

from zerodist.pipe.checkpointing import (checkpoint, configure, is_configured, model_parallel_cuda_manual_seed,
                                         non_reentrant_checkpoint, reset)

__all__ = ["checkpoint", "configure", "is_configured", "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint",
           "reset"]
