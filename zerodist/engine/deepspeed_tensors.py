"""DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and its kin, on zerodist's flat groups.

DeepSpeed scripts read and write one parameter's training state through these functions, whatever
the stage: its fp32 (master) value, its reduced gradient, an optimizer state (``"exp_avg"``), either
whole (``safe_get_full_*``: every rank gets the whole tensor; collective) or this rank's partition
(``safe_get_local_*``: the elements this rank steps, flattened, in order). Here a parameter's
elements live in its flat group's buckets: each rank steps the shard it owns
(``layout.owned_slices(rank)``), so a whole value is the owned pieces of every rank, summed over the
group's ranks (each element is owned by exactly one), and a write goes to the owned pieces.

A parameter zerodist does not train (frozen, or not in any engine) gives None, as in DeepSpeed.
Writes: the fp32 value also reaches the parameter itself (cast to its dtype); a gradient written
between backward and step is what the step uses; an optimizer state is stepped from.
zerodist's bookkeeping stays in its side tables: nothing is read from or set on the parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.engine.deepspeed_surface import live_engines
from zerodist.offload.optimizer import SwappedOptimizer
from zerodist.zero.flat_group import FlatParamGroup

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]

FP32, GRAD = "fp32", "grad"  # the kinds besides an optimizer state's key


def _locate(param: torch.Tensor) -> tuple[FlatParamGroup, int] | None:
    """`param`'s flat group (in a live engine) and its index there; None for a parameter not trained."""
    for engine in live_engines():
        for group in engine.zero_state.groups:
            for index, record in enumerate(group.records):
                if record.param is param:
                    return group, index
    return None


def _pieces(group: FlatParamGroup, index: int) -> list[tuple[int, int, int, int]]:
    """(bucket, start in the parameter, length, start in the bucket's owned part) of what this rank owns."""
    layout = group.layout
    bases, base = [], 0
    for span in layout.buckets:
        bases.append(base)
        base += span.shard_numel
    bucket = layout.slots[index].bucket
    return [(bucket, s.param_start, s.length, s.shard_start - bases[bucket])
            for s in layout.owned_slices(group.rank) if s.param_index == index]


def _inner_optimizer(group: FlatParamGroup) -> Any:
    for engine in live_engines():
        if any(g is group for g in engine.zero_state.groups):
            return engine.optimizer.inner
    return None


def _inner_state(group: FlatParamGroup, bucket: int) -> dict[str, Any]:
    inner = _inner_optimizer(group)
    return {} if inner is None else inner.state.get(group.optimizer_tensors[bucket], {})


def _bucket_tensor(group: FlatParamGroup, bucket: int, kind: str) -> torch.Tensor | None:
    """The optimizer-space tensor of `bucket` for `kind` (None: an optimizer state not made yet)."""
    if kind == FP32:
        return group.stepped_values(bucket)
    if kind == GRAD:
        return group.reduced_grad(bucket)
    value = _inner_state(group, bucket).get(kind)
    return value if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _get_local(param: torch.Tensor, kind: str) -> torch.Tensor | None:
    found = _locate(param)
    if found is None:
        return None
    group, index = found
    parts = []
    for bucket, _, length, at in _pieces(group, index):
        tensor = _bucket_tensor(group, bucket, kind)
        if tensor is None:
            return None
        parts.append(group.owned_part(bucket, tensor)[at: at + length])
    dtype = group.param_dtype if kind == GRAD else torch.float32
    return torch.cat(parts).detach().clone() if parts else torch.empty(0, dtype=dtype, device=group.device)


def _get_full(param: torch.Tensor, kind: str) -> torch.Tensor | None:
    found = _locate(param)
    if found is None:
        return None
    group, index = found
    out: torch.Tensor | None = None
    missing = torch.zeros(1, device=group.device)
    for bucket, start, length, at in _pieces(group, index):
        tensor = _bucket_tensor(group, bucket, kind)
        if tensor is None:
            missing += 1
            continue
        if out is None:
            out = torch.zeros(param.numel(), dtype=tensor.dtype, device=group.device)
        out[start: start + length] = group.owned_part(bucket, tensor)[at: at + length]
    if out is None:  # this rank owns none of it: the dtype of what the others own
        dtype = group.param_dtype if kind == GRAD else torch.float32
        out = torch.zeros(param.numel(), dtype=dtype, device=group.device)
    comm.all_reduce(missing, group=group.group)
    if missing.item() > 0:
        return None
    comm.all_reduce(out, group=group.group)  # each element is owned by one rank: the sum is the whole
    return out.view(param.shape)


def _write(param: torch.Tensor, kind: str, value: torch.Tensor, local: bool) -> None:
    found = _locate(param)
    if found is None:
        return
    group, index = found
    flat = value.detach().reshape(-1)
    offset = 0
    for bucket, start, length, at in _pieces(group, index):
        source = flat[offset: offset + length] if local else flat[start: start + length]
        offset += length
        if kind == FP32:
            values = group.stepped_values(bucket)
            group.owned_part(bucket, values)[at: at + length].copy_(source)
            group.write_stepped(bucket, values)
            continue
        if kind != GRAD and isinstance(_inner_optimizer(group), SwappedOptimizer):
            # its state[...] is a copy read back from the swap files: a write there would be lost
            raise NotImplementedError(f"setting optimizer state {kind!r} with offload_optimizer device nvme: the "
                                      "state lives in swap files (reading it works); save a checkpoint, change it "
                                      "and load it instead")
        tensor = _bucket_tensor(group, bucket, kind)
        if tensor is None:
            raise KeyError(f"no optimizer state {kind!r} for this parameter yet (before the first step, or "
                           "the optimizer keeps no such state)")
        group.owned_part(bucket, tensor)[at: at + length].copy_(source)
    if kind == FP32:
        group.copy_master_to_params()  # mixed precision: the new master values, cast into the parameters
        if not local and not group.policy.shard_parameters:
            with torch.no_grad():  # every rank holds the whole parameter: the whole new value, on each
                param.copy_(flat.view(param.shape))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 (master) value of `param`, on every rank; collective."""
    return _get_full(param, FP32)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole reduced gradient of `param` (between backward and step), on every rank; collective."""
    return _get_full(param, GRAD)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state `optim_state_key` ("exp_avg", ...) of `param`; collective."""
    return _get_full(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s fp32 value (and the parameter) from the whole `value`, the same on every rank."""
    _write(param, FP32, value, local=False)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _write(param, GRAD, value, local=False)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _write(param, optim_state_key, value, local=False)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's partition of `param`'s fp32 value: the elements it steps, flattened, in order."""
    return _get_local(param, FP32)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    return _get_local(param, GRAD)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return _get_local(param, optim_state_key)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _write(param, FP32, value, local=True)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _write(param, GRAD, value, local=True)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _write(param, optim_state_key, value, local=True)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.Tensor],
                                     update_func: Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]) -> None:
    """Each parameter's whole gradient replaced by `update_func(old_whole_gradient, param)`; collective."""
    for param in param_list:
        new = update_func(safe_get_full_grad(param), param)
        if new is not None:
            safe_set_full_grad(param, new)
