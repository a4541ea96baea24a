"""DeepSpeed's activation-checkpointing API (``deepspeed.checkpointing``, served from
``zerodist.runtime.activation_checkpointing.checkpointing``) on torch's ``torch.utils.checkpoint``.

``checkpoint(function, *args)`` recomputes `function`'s forward in the backward pass (torch's
reentrant checkpoint, as DeepSpeed's is); ``non_reentrant_checkpoint`` is torch's non-reentrant one.
``configure()`` takes DeepSpeed's settings: ``partition_activations`` splits saved activations over
the tensor-parallel ranks and ``contiguous_memory_optimization`` packs them, which change no result
and here, with one copy per rank (no ``mpu``), nothing else either; ``cpu_checkpointing`` keeps the
saved inputs on the CPU, which zerodist does not do, so ``True`` is refused on a GPU (on the CPU it
is what happens anyway); ``synchronize``/``profile`` only time things in DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint",
           "reset"]

_SETTINGS: dict[str, Any] = {}


def checkpoint(function: Any, *args: Any) -> Any:
    """`function(*args)`, its activations recomputed in the backward pass (reentrant, as DeepSpeed's)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function: Any, *args: Any) -> Any:
    """`function(*args)` under torch's non-reentrant checkpoint (inputs need not require grad)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Record DeepSpeed's activation-checkpointing settings (see the module's docstring for what each means here)."""
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...) is not supported: zerodist builds its own process groups")
    if checkpoint_in_cpu and torch.cuda.is_available():
        raise ValueError("checkpointing.configure(checkpoint_in_cpu=True): zerodist keeps checkpointed inputs on the "
                         "device; remove it (activation checkpointing itself works)")
    _SETTINGS.update(partition_activations=bool(partition_activations),
                     contiguous_checkpointing=bool(contiguous_checkpointing), num_checkpoints=num_checkpoints,
                     checkpoint_in_cpu=bool(checkpoint_in_cpu), synchronize=bool(synchronize), profile=bool(profile),
                     deepspeed_config=deepspeed_config)


def is_configured() -> bool:
    return bool(_SETTINGS)


def reset() -> None:
    """Forget the settings (DeepSpeed frees its contiguous buffers here)."""
    _SETTINGS.clear()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed torch's generators (one copy of the model per rank here: no per-tensor-rank offset)."""
    torch.manual_seed(seed)
