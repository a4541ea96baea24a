"""``deepspeed.utils.zero_to_fp32`` under ``import deepspeed`` served by zerodist: the fp32 weights of a
checkpoint saved by ``engine.save_checkpoint`` (any stage, any world size), with no process group:
zerodist's ``zerodist.checkpoint.consolidate_checkpoint`` under DeepSpeed's names."""

from __future__ import annotations

from typing import Any

import torch

from zerodist.checkpoint.consolidate import consolidate_checkpoint

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's `state_dict()` from the checkpoint under `checkpoint_dir` (tag: the newest
    committed by default), parameters in fp32 (the master weights under mixed precision). The tensors
    are read at once whatever `lazy_mode` says (they have `.contiguous()`, as DeepSpeed's lazy ones do)."""
    if exclude_frozen_parameters:
        raise ValueError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True): zerodist "
                         "checkpoints hold every parameter; drop the frozen keys from the result instead")
    return consolidate_checkpoint(checkpoint_dir, tag=tag)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
                                         ) -> torch.nn.Module:
    """DeepSpeed's: `model` moved to the CPU with the checkpoint's fp32 weights loaded (strict=False)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.utils.zero_to_fp32 has no {name!r} here: `import deepspeed` is served by "
                         "zerodist, which gives get_fp32_state_dict_from_zero_checkpoint and "
                         "load_state_dict_from_zero_checkpoint (or zerodist.checkpoint.consolidate_checkpoint)")
