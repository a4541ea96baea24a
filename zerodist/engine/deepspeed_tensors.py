"""DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and its kin, on zerodist's flat groups.

DeepSpeed scripts read and write one parameter's training state through these functions, whatever
the stage: its fp32 (master) value, its reduced gradient, an optimizer state (``"exp_avg"``), either
whole (``safe_get_full_*``: every rank gets the whole tensor; collective) or this rank's partition
(``safe_get_local_*``: the elements this rank steps, flattened, in order). Here a parameter's
elements live in its flat group's buckets: each rank steps the shard it owns
(``layout.owned_slices(rank)``) with sharded optimizer state (stages 1-3), so a whole value is the
owned pieces of every rank, summed over the group's ranks (each element is owned by exactly one), and
a write goes to the owned pieces; at stage 0 every rank steps every bucket whole, so a whole value is
this rank's and a write goes to the whole slot (on every rank alike).

Every call first agrees over the engine's data-parallel ranks (one small all_gather_object; a rank
that passed a parameter no engine trains joins the same group: `_agreement_group`) that the same
parameter is trained on all of them or none, its size, the state asked for, a written value's size
and (gradients) that the call is between a reducing backward and the step: bad input raises the same
error on every rank, not a hang (one limit: `_agreement_group`, engines over different meshes). fp16 gradients come back loss-scaled, as DeepSpeed's do.

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

_WINDOW = "Gradients are only available immediately after backward and before engine step"


class AccessorError(ValueError):
    """A DeepSpeed accessor was called with input that does not fit (raised alike on every rank)."""


def _locate(param: torch.Tensor) -> tuple[Any, FlatParamGroup, int] | None:
    """`param`'s engine, flat group (in a live engine) and its index there; None for a parameter not trained."""
    for engine in live_engines():
        for group in engine.zero_state.groups:
            for index, record in enumerate(group.records):
                if record.param is param:
                    return engine, group, index
    return None


def _pieces(group: FlatParamGroup, index: int) -> list[tuple[int, int, int, int]]:
    """(bucket, start in the parameter, length, start in the bucket's optimizer-space tensor) of
    what this rank steps: its owned slices with sharded optimizer state, the whole slot otherwise
    (stage 0: every rank steps every bucket whole)."""
    layout = group.layout
    slot = layout.slots[index]
    if not group.views.sharded_steps:
        return [(slot.bucket, 0, slot.numel, slot.offset - layout.buckets[slot.bucket].offset)]
    bases, base = [], 0
    for span in layout.buckets:
        bases.append(base)
        base += span.shard_numel
    return [(slot.bucket, s.param_start, s.length, s.shard_start - bases[slot.bucket])
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


def _grad_window(engine: Any) -> str | None:
    """Why `engine`'s reduced gradients cannot be read or written now; None inside the window (the
    same on every rank: the engine's state is)."""
    if not engine._backward_pending:
        return (f"{_WINDOW} (before the first backward, or after step()): call it between "
                "engine.backward(loss) and engine.step()")
    reducer = engine.reducer
    if getattr(reducer, "_deferred", False) or not (engine.sharding.shard_gradients or reducer.sync_enabled):
        return (f"{_WINDOW}, at an accumulation boundary: at ZeRO stage {engine.stage} the last backward "
                "was not at a gradient accumulation boundary, so the gradients are this rank's, not reduced yet; "
                "read them after the boundary's backward")
    return None


def _agreement_group(found: tuple[Any, FlatParamGroup, int] | None) -> Any:
    """The data-parallel group over which every rank agrees on the call; None without a live engine.

    A rank that passed a parameter no engine trains must join the group the other ranks agree over,
    or they would wait for it (a hang). Engines over the same mesh share their groups (comm/topology.py
    makes one group per partition of the world), so when every live engine's data-parallel group is
    the same group, that is the one, whatever was passed and whichever engines the garbage collector
    has freed on each rank so far. The limit: engines over different meshes (a tensor-parallel policy
    beside a plain reference model) have different groups; a trained parameter agrees over its own
    engine's, a stranger over the newest engine's, and a rank that passed a stranger while its peers
    passed a trained parameter of another mesh's engine waits for them as they wait for it. There,
    as in DeepSpeed, the same parameter on every rank is the caller's part."""
    if found is not None:
        return _batch_group(found[0])
    groups = list({id(group): group for group in map(_batch_group, live_engines())}.values())
    return groups[-1] if groups else None


def _batch_group(engine: Any) -> Any:
    return engine.topology.group(*engine.topology.batch_axes)


def _problem(found: tuple[Any, FlatParamGroup, int] | None, kind: str,
             value: torch.Tensor | None, local: bool) -> tuple[str, str] | None:
    """What is wrong with this call on this rank, as (error kind, message); None when nothing is."""
    if found is None:
        return None
    engine, group, index = found
    if kind == GRAD and (why := _grad_window(engine)) is not None:
        return "window", why
    if _bucket_tensor(group, group.layout.slots[index].bucket, kind) is None:
        return "state", (f"no optimizer state {kind!r} for this parameter yet (before the first step, or the "
                         "optimizer keeps no such state)")
    if value is not None:
        want = sum(length for _, _, length, _ in _pieces(group, index)) if local else group.layout.slots[index].numel
        if value.numel() != want:
            which = "this rank's partition (safe_get_local_*'s size)" if local else "the parameter"
            return "size", f"the value has {value.numel()} elements; {which} has {want}"
    return None


def _agree(param: torch.Tensor, kind: str, value: torch.Tensor | None = None,
           local: bool = False) -> tuple[FlatParamGroup, int] | None:
    """Every rank checks the call together before any other collective, so bad input raises the same
    error on every rank (never a hang): `param` trained on all ranks or none (None: none), the same
    size, the state there, a written value's size right, gradients inside their window."""
    found = _locate(param)
    agreement = _agreement_group(found)
    if agreement is None:
        return None
    report = (found is not None, param.numel(), _problem(found, kind, value, local), _position(found))
    reports: list[Any] = [report]
    if comm.is_initialized() and comm.get_world_size(agreement) > 1:
        reports = [None] * comm.get_world_size(agreement)
        comm.all_gather_object(reports, report, group=agreement)
    _raise_disagreement(reports)
    if not report[0]:
        return None
    assert found is not None
    if value is not None and kind not in (FP32, GRAD) and isinstance(found[0].optimizer.inner, SwappedOptimizer):
        # the same on every rank (agreed: the same parameter of the same engine, whose config says so);
        # its state[...] is a copy read back from the swap files
        raise NotImplementedError(f"setting optimizer state {kind!r} with offload_optimizer device nvme: the "
                                  "state lives in swap files (reading it works); save a checkpoint, change it "
                                  "and load it instead")
    if any(r[2] is not None and r[2][0] == "state" for r in reports) and value is None:
        return None  # a read of a state not made yet (on some rank): None, as DeepSpeed
    for rank, (_, _, problem, _) in enumerate(reports):
        if problem is not None:
            error = {"window": RuntimeError, "state": KeyError}.get(problem[0], AccessorError)
            raise error(f"rank {rank}: {problem[1]}")
    return found[1], found[2]


def _position(found: tuple[Any, FlatParamGroup, int] | None) -> tuple[int, int, int] | None:
    """Where a trained parameter sits (its engine's serial number, its flat group, its index there):
    the same parameter has the same position on every data-parallel rank."""
    if found is None:
        return None
    engine, group, index = found
    return engine._serial, next(i for i, g in enumerate(engine.zero_state.groups) if g is group), index


def _raise_disagreement(reports: list[Any]) -> None:
    trained = [rank for rank, r in enumerate(reports) if r[0]]
    if trained and len(trained) != len(reports):
        raise AccessorError(f"the parameter is trained by zerodist on ranks {trained} but not on the others: "
                            "call DeepSpeed's accessors with the same parameter on every rank")
    sizes = {r[1] for r in reports}
    if trained and len(sizes) > 1:
        raise AccessorError(f"the ranks passed parameters of different sizes {sorted(sizes)}: call DeepSpeed's "
                            "accessors with the same parameter on every rank, in the same order")
    positions = {r[3] for r in reports}
    if trained and len(positions) > 1:
        raise AccessorError(f"the ranks passed different parameters (engine, flat group, index: {sorted(positions)}): "
                            "call DeepSpeed's accessors with the same parameter on every rank, in the same order")


def _get_local(param: torch.Tensor, kind: str) -> torch.Tensor | None:
    agreed = _agree(param, kind)
    if agreed is None:
        return None
    group, index = agreed
    parts = []
    tensor = None
    for bucket, _, length, at in _pieces(group, index):
        tensor = _bucket_tensor(group, bucket, kind)
        assert tensor is not None  # agreed
        parts.append(tensor[at: at + length])
    if not parts:
        tensor = _bucket_tensor(group, group.layout.slots[index].bucket, kind)
        assert tensor is not None
        return torch.empty(0, dtype=tensor.dtype, device=group.device)
    return torch.cat(parts).detach().clone()


def _get_full(param: torch.Tensor, kind: str) -> torch.Tensor | None:
    agreed = _agree(param, kind)
    if agreed is None:
        return None
    group, index = agreed
    tensor = _bucket_tensor(group, group.layout.slots[index].bucket, kind)  # every rank has its bucket's
    assert tensor is not None  # agreed
    out = torch.zeros(param.numel(), dtype=tensor.dtype, device=group.device)
    for _, start, length, at in _pieces(group, index):
        out[start: start + length] = tensor[at: at + length]
    if group.views.sharded_steps:  # each element is owned by one rank: the sum is the whole
        comm.all_reduce(out, group=group.group)
    return out.view(param.shape)


def _write(param: torch.Tensor, kind: str, value: torch.Tensor, local: bool) -> None:
    agreed = _agree(param, kind, value, local)
    if agreed is None:
        return
    group, index = agreed
    flat = value.detach().reshape(-1)
    offset = 0
    for bucket, start, length, at in _pieces(group, index):
        source = flat[offset: offset + length] if local else flat[start: start + length]
        offset += length
        if kind == FP32:
            values = group.stepped_values(bucket)
            values[at: at + length].copy_(source)
            group.write_stepped(bucket, values)
            continue
        tensor = _bucket_tensor(group, bucket, kind)
        assert tensor is not None  # agreed
        tensor[at: at + length].copy_(source)
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
        old = safe_get_full_grad(param)
        if old is None:  # not trained here (frozen, or in no engine): skipped, as DeepSpeed does
            continue
        new = update_func(old, param)
        if new is not None:
            safe_set_full_grad(param, new)
