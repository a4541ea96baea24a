"""Are the replicas still replicas? Gradients and weights compared across data-parallel ranks.

    check_weight_sync(engine_or_model)          any time; parameters must be bitwise equal
    check_gradient_sync(engine_or_model)        after backward at the accumulation boundary,
                                                before engine.step() (which clears gradients)

What is comparable depends on where the reduced gradient lives:

- a plain model (DDP-style `.grad`s) and ZeRO stage 0: every rank holds the whole reduced
  gradient, so the ranks are compared directly, bitwise by default;
- ZeRO stages 1-3: each rank holds only its own shard of the reduced gradient, so no two ranks
  hold the same numbers. What can be checked is each shard against a *reference reduction*: a
  `GradSyncWatch` keeps a copy of this rank's unreduced gradients (from the reducer's one
  gradient hook, before they enter the buckets), the check all-reduces those copies through a
  different collective (all_reduce, not the buckets' reduce-scatter) and compares every rank's
  owned shard with its slice of that result, within a tolerance for the different summation
  order. It costs one fp32 copy of the gradients: a debugging tool, not a production default.

[Note: comparing replicas] Each rank sends per parameter an L2 norm and a position-weighted
checksum of the raw bits (an all_gather of 2 numbers per parameter). Ranks are grouped by
checksum; the largest group (ties: the one holding the lowest rank) is the reference, and only
for parameters where groups differ is the reference rank's tensor broadcast so that every rank
can report its max abs difference. In-sync parameters cost O(1) communication each.

With experts or tensor slices (several sharding domains), each parameter is compared over the
ranks that should agree on it, and the results are merged so that every rank gets the same
report and raises together.

All functions are collectives (over the data-parallel group; with several sharding domains, over
the world): call them on every rank.
This layer never imports the engine: it reads the engine's typed `zero_state`
(`zerodist.zero.state.ZeroState`) and its public step counter and accumulation boundary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.comm.topology import PARAMETER_AXES
from zerodist.debug.sync_report import (GradientSyncError, ParamSync, SyncReport, WeightSyncError,
                                        reference_label)
from zerodist.debug.engine_view import TrainingEngine, state_of
from zerodist.utils import get_logger
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.state import zero_state_of

logger = get_logger(__name__)

_MISSING = -(2**62) + 7  # checksum of "this rank has no tensor here" (no real sum is this by chance)
_INT_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Shards against the reference reduction: relative to the parameter's largest |gradient|,
# since the two reductions add the same numbers in a different order.
DEFAULT_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 3e-3}

Named = list[tuple[str, int, "torch.Tensor | None"]]  # (name, numel, tensor or None)


def _is_engine(obj: Any) -> bool:
    return zero_state_of(obj) is not None


def checksum(tensor: torch.Tensor) -> int:
    """Order-sensitive checksum of `tensor`'s bits: sum of bits * (2i + 1), modulo 2^64."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_VIEWS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, 2 * bits.numel() + 1, 2, dtype=torch.int64, device=bits.device)
    return int((bits * weights).sum())  # int64 arithmetic wraps: modular, so order-independent


def group_ranks(group: Group) -> list[int]:
    return [comm.get_global_rank(group, i) for i in range(comm.get_world_size(group))]


def _gather(values: torch.Tensor, group: Group) -> torch.Tensor:
    """[size, *values.shape]: every rank's `values`."""
    out = torch.empty(comm.get_world_size(group) * values.numel(), dtype=values.dtype, device=values.device)
    comm.all_gather(out, values.reshape(-1), group=group)
    return out.view(-1, *values.shape)


def compare_replicated(named: Named, group: Group, *, atol: float = 0.0) -> tuple[ParamSync, ...]:
    """Compare tensors that every rank of `group` should hold identically (see [Note: comparing
    replicas]). `atol` > 0 accepts differences up to it."""
    device = next((t.device for _, _, t in named if t is not None), comm.device_for_rank())
    norms = torch.full((len(named),), math.nan, dtype=torch.float64, device=device)
    sums = torch.full((len(named),), _MISSING, dtype=torch.int64, device=device)
    for i, (_, _, tensor) in enumerate(named):
        if tensor is not None:
            norms[i] = tensor.detach().double().norm()
            sums[i] = checksum(tensor)
    all_norms, all_sums = _gather(norms, group).cpu(), _gather(sums, group).cpu()
    ranks = group_ranks(group)
    references: dict[int, int] = {}  # parameter -> group rank whose values are the reference
    labels: dict[int, str] = {}
    for i in range(len(named)):
        by_sum: dict[int, list[int]] = {}
        for r, value in enumerate(all_sums[:, i].tolist()):
            by_sum.setdefault(value, []).append(r)
        if len(by_sum) > 1:
            members = max(by_sum.values(), key=lambda m: (len(m), -m[0]))
            references[i], labels[i] = members[0], reference_label(ranks, members)
    diffs = _diffs_from_references(named, references, group, device)
    result = []
    for i, (name, _, _) in enumerate(named):
        column = diffs.get(i)
        differing = () if column is None else tuple(
            ranks[r] for r, d in enumerate(column) if math.isnan(d) or d > atol)
        worst = 0.0 if column is None else max(column, key=lambda d: math.inf if math.isnan(d) else d)
        result.append(ParamSync(name, tuple(all_norms[:, i].tolist()), worst, differing, labels.get(i, ""),
                                tolerance=atol))
    return tuple(result)


def _diffs_from_references(named: Named, references: dict[int, int], group: Group,
                           device: torch.device) -> dict[int, list[float]]:
    """For each parameter in `references`: every rank's max |mine - reference's| (nan where a
    rank or the reference has no tensor). One broadcast per distinct reference rank."""
    result: dict[int, list[float]] = {}
    for ref in sorted(set(references.values())):
        indices = [i for i in sorted(references) if references[i] == ref]
        mine = [named[i][2] for i in indices]
        flat = torch.cat([torch.zeros(named[i][1], dtype=torch.float64, device=device) if t is None
                          else t.detach().reshape(-1).double() for i, t in zip(indices, mine)])
        present = torch.tensor([t is not None for t in mine], dtype=torch.float64, device=device)
        reference, present_ref = flat.clone(), present.clone()
        for tensor in (reference, present_ref):
            comm.broadcast(tensor, src=comm.get_global_rank(group, ref), group=group)
        local = torch.empty(len(indices), dtype=torch.float64, device=device)
        start = 0
        for k, i in enumerate(indices):
            numel = named[i][1]
            piece = (flat[start:start + numel] - reference[start:start + numel]).abs()
            local[k] = piece.max() if numel else 0.0
            if not (present[k] and present_ref[k]):
                local[k] = math.nan
            start += numel
        gathered = _gather(local, group).cpu()
        for k, i in enumerate(indices):
            result[i] = gathered[:, k].tolist()
    return result


# ---------------------------------------------------------------------------------------- gradients

class GradSyncWatch:
    """Keeps this rank's unreduced gradients, as the reference for `check_gradient_sync` at ZeRO
    stages 1-3 (and a second opinion at stage 0). Create it before the backward you check:

        watch = GradSyncWatch(engine)
        engine.backward(loss)
        watch.check(raise_on_mismatch=True)     # = check_gradient_sync(engine, reference=watch)
        engine.step()

    Observes the reducer's single gradient hook (no hook of its own); costs one fp32 copy of
    the gradients. Accumulation follows the engine: the copy restarts after each optimizer step.
    """

    def __init__(self, engine: TrainingEngine):
        if not _is_engine(engine):
            raise TypeError(f"GradSyncWatch takes a zerodist engine, got {type(engine).__name__}")
        self.engine, self.zero = engine, state_of(engine)
        self.local = {id(g): torch.zeros(g.layout.total_numel, dtype=torch.float32, device=g.device)
                      for g in self.zero.groups}
        self._step = engine.global_steps
        self.zero.reducer.grad_observers.append(self._on_grad)

    def _on_grad(self, group: FlatParamGroup, index: int, grad: torch.Tensor) -> None:
        if self._step != self.engine.global_steps:  # an optimizer step cleared the buckets
            for buffer in self.local.values():
                buffer.zero_()
            self._step = self.engine.global_steps
        slot = group.layout.slots[index]
        self.local[id(group)][slot.offset: slot.offset + slot.numel].add_(grad.detach().reshape(-1))

    def check(self, *, raise_on_mismatch: bool = False, rtol: float | None = None) -> SyncReport:
        return check_gradient_sync(self.engine, raise_on_mismatch=raise_on_mismatch, reference=self, rtol=rtol)

    def close(self) -> None:
        observers = self.zero.reducer.grad_observers
        if self._on_grad in observers:
            observers.remove(self._on_grad)
        self.local = {}


def check_gradient_sync(model_or_engine: torch.nn.Module | TrainingEngine, *, raise_on_mismatch: bool = False,
                        atol: float = 0.0,
                        reference: GradSyncWatch | None = None, rtol: float | None = None,
                        group: Group = None) -> SyncReport:
    """Compare across data-parallel ranks every gradient that should agree after reduction.

    Engine: call after `engine.backward(loss)` at the accumulation boundary and before
    `engine.step()`. Stage 0 compares the replicated reduced gradient bitwise (`atol` to relax);
    with `reference` (any stage, required from stage 1) each rank's owned shard is compared with
    a reference reduction of the watched local gradients, within `rtol` of the parameter's
    largest |gradient| (default by dtype). Each sharding domain (experts, tensor slices) is
    compared over the ranks it is reduced over. A plain model: its `.grad`s over `group` (default
    world), as DDP leaves them. Returns a `SyncReport`; raises `GradientSyncError` on every rank
    with `raise_on_mismatch` when any parameter differs. Collective.
    """
    if _is_engine(model_or_engine):
        report = _engine_gradients(cast(TrainingEngine, model_or_engine), atol, reference, rtol)
    else:
        model = cast(torch.nn.Module, model_or_engine)  # not an engine: a plain model
        named = [(n, p.numel(), p.grad) for n, p in model.named_parameters() if p.requires_grad]
        params = compare_replicated(named, group, atol=atol)
        note = "no parameter has a gradient" if all(t is None for _, _, t in named) else ""
        report = SyncReport("gradients", "each rank's .grad compared " + _how(atol),
                            tuple(group_ranks(group)), params, note)
    if not report.ok:
        logger.warning("check_gradient_sync: %s", report.format())
        if raise_on_mismatch:
            raise GradientSyncError(report, "check_gradient_sync")
    return report


def _how(atol: float) -> str:
    return "bitwise" if atol == 0 else f"within {atol:g}"


def _engine_gradients(engine: TrainingEngine, atol: float, reference: GradSyncWatch | None,
                      rtol: float | None) -> SyncReport:
    state = state_of(engine)
    sharding = state.sharding
    stage = sharding.stage
    if sharding.shard_optimizer_state and reference is None:
        raise ValueError(f"check_gradient_sync: at ZeRO stage {stage} each rank holds only its own shard of the "
                         "reduced gradient, so there is nothing replicated to compare; create "
                         "zerodist.debug.GradSyncWatch(engine) before backward and pass it as reference=")
    if not sharding.shard_gradients and not engine.is_gradient_accumulation_boundary():
        raise ValueError(f"check_gradient_sync: at ZeRO stage {stage} gradients are reduced only at the "
                         "accumulation boundary; call it after the boundary micro-step's engine.backward(loss)")
    # Each sharding domain's gradients are reduced, so replicated, over its own group (the data
    # ranks for dense parameters; with experts or tensor slices, see docs/design/zero.md,
    # "Sharding domains and the policy").
    by_axes: dict[tuple[str, ...], list[Any]] = {}
    for flat in state.groups:
        by_axes.setdefault(flat.domain.reduce_axes, []).append(flat)
    found: list[tuple[Any, tuple[ParamSync, ...]]] = []
    for axes in sorted(by_axes):  # the same order on every rank: each comparison is a collective
        flats = by_axes[axes]
        group = flats[0].group
        if reference is not None:
            found.append((group, _compare_with_reference(flats, reference, rtol)))
        else:
            named = [(r.name, r.slot.numel, g.grad_buffer[r.slot.offset: r.slot.offset + r.slot.numel])
                     for g in flats for r in g.records]
            found.append((group, compare_replicated(named, group, atol=atol)))
    world_size = state.topology.world_size
    params = _merged(found, world_size)
    if reference is not None:
        method = f"ZeRO stage {stage}: each rank's owned shard against a reference all_reduce of the local gradients"
    else:
        method = "ZeRO stage 0: the reduced gradient is replicated, compared " + _how(atol)
    if not _spans_world(found, world_size):
        method += ", each sharding domain over the ranks it reduces over"
    cleared = not any(grp.holds_gradients() for grp in state.groups)
    note = ("no gradient since the last optimizer step: called after engine.step(), which clears them?"
            if cleared else "")
    return SyncReport("gradients", method, tuple(range(world_size)), params, note)


def _spans_world(found: list[tuple[Any, tuple[ParamSync, ...]]], world_size: int) -> bool:
    """Whether every comparison ran over all ranks (the same answer on every rank: a comparison's
    group has the same size on all ranks)."""
    return all(comm.get_world_size(group) == world_size for group, _ in found)


def _merged(found: list[tuple[Any, tuple[ParamSync, ...]]], world_size: int) -> tuple[ParamSync, ...]:
    """One report from comparisons over several groups, the same on every rank: this rank's own
    results, norms placed by global rank (nan for the ranks outside each group, which hold another
    slice or other experts), plus what differs in the groups this rank is not in, named with that
    group's ranks. Without the second part a rank whose groups agree would not raise while another
    did, and would wait alone at its next collective. Collective over the world."""
    mine: list[ParamSync] = []
    differing: list[tuple[tuple[int, ...], ParamSync]] = []
    for group, syncs in found:
        members = tuple(group_ranks(group))
        for sync in syncs:
            norms = [math.nan] * world_size
            for rank, norm in zip(members, sync.rank_norms):
                norms[rank] = norm
            placed = dataclasses.replace(sync, rank_norms=tuple(norms))
            mine.append(placed)
            if not placed.in_sync:
                differing.append((members, placed))
    if _spans_world(found, world_size):  # every rank is in every comparison: nothing found elsewhere
        return tuple(mine)
    everyone: list[Any] = [None] * world_size
    comm.all_gather_object(everyone, differing)
    rank, seen = comm.get_rank(), set()
    for members, sync in (item for items in everyone for item in items):
        if rank in members or (members, sync.name) in seen:  # found here too, or by another member
            continue
        seen.add((members, sync.name))
        mine.append(dataclasses.replace(sync, name=f"{sync.name} (on ranks {', '.join(map(str, members))})"))
    return tuple(mine)


def _compare_with_reference(flats: list[Any], watch: GradSyncWatch, rtol: float | None) -> tuple[ParamSync, ...]:
    """Each rank's owned shard of every bucket of `flats` (flat groups reduced over one group)
    against its slice of all_reduce(local) / N."""
    results = []
    for flat in flats:
        group, rank, size = flat.group, flat.rank, flat.world_size
        expected = watch.local[id(flat)].clone()
        comm.all_reduce(expected, group=group)
        expected.div_(flat.domain_group.grad_divisor)
        tol = rtol if rtol is not None else DEFAULT_RTOL.get(flat.param_buffer.dtype, 1e-5)
        # per parameter: squared norm of the owned part, max |owned - expected|, owns any
        local = torch.zeros(len(flat.records), 3, dtype=torch.float64, device=expected.device)
        for bucket in flat.buckets:
            lo = bucket.span.shard_offset(rank)
            owned = bucket.grad_owned.double()
            for index in bucket.span.param_indices:
                slot = flat.layout.slots[index]
                start, end = max(lo, slot.offset), min(lo + bucket.span.shard_numel, slot.offset + slot.numel)
                if start >= end:
                    continue
                mine = owned[start - lo: end - lo]
                local[index] = torch.stack([mine.pow(2).sum(), (mine - expected[start:end].double()).abs().max(),
                                            torch.ones((), dtype=torch.float64)])
        everyone = _gather(local, group).cpu()
        ranks = group_ranks(group)
        for index, record in enumerate(flat.records):
            name, slot = record.name, record.slot
            full = expected[slot.offset: slot.offset + slot.numel].double()
            threshold = tol * float(full.abs().max())
            owners = [r for r in range(size) if everyone[r, index, 2] > 0]
            diffs = [float(everyone[r, index, 1]) for r in owners]
            differing = tuple(ranks[r] for r, d in zip(owners, diffs) if math.isnan(d) or d > threshold)
            norms = tuple(math.sqrt(everyone[r, index, 0]) if everyone[r, index, 2] > 0 else math.nan
                          for r in range(size))
            results.append(ParamSync(name, norms, max(diffs, default=0.0), differing, "the reference reduction",
                                     reference_norm=float(full.norm()), tolerance=threshold))
    return tuple(results)


# ---------------------------------------------------------------------------------------- weights

def _check_engine_weights(zero: Any, *, raise_on_mismatch: bool, atol: float, buffers: bool) -> SyncReport:
    """Each parameter compared over the ranks its domain replicates it on (a tensor-parallel slice
    over the data axes; a LayerNorm beside it over the data and tensor axes), buffers over all."""
    topology = zero.topology
    domains = {id(r.param): r.domain for g in zero.groups for r in g.records}
    by_axes: dict[tuple[str, ...], Named] = {}
    for name, param in zero.module.named_parameters():
        axes = domains[id(param)].replicated_axes if id(param) in domains else topology.batch_axes
        by_axes.setdefault(axes, []).append((name, param.numel(), param.detach()))
    if buffers:
        by_axes.setdefault(PARAMETER_AXES, []).extend(
            (n, b.numel(), b) for n, b in zero.module.named_buffers())
    found = []
    for axes in sorted(by_axes):  # the same order on every rank: each comparison is a collective
        group = topology.group(*axes)
        found.append((group, compare_replicated(by_axes[axes], group, atol=atol)))
    params = _merged(found, topology.world_size)
    what = "parameters and buffers" if buffers else "parameters"
    report = SyncReport(what, "compared " + _how(atol) + " over each parameter's replicated axes",
                        tuple(range(topology.world_size)), params)
    if not report.ok:
        logger.warning("check_weight_sync: %s", report.format())
        if raise_on_mismatch:
            raise WeightSyncError(report, "check_weight_sync")
    return report


def check_weight_sync(model_or_engine: torch.nn.Module, *, raise_on_mismatch: bool = False, atol: float = 0.0,
                      buffers: bool = False, group: Group = None) -> SyncReport:
    """Compare every parameter (and, with `buffers`, every buffer) across data-parallel ranks,
    bitwise unless `atol` is given: replicas that drifted apart (a missed sync, a rank-dependent
    update) are named with the ranks that differ. Raises `WeightSyncError` on every rank with
    `raise_on_mismatch`. For an engine each parameter is compared over the axes its domain
    replicates it on (tensor-parallel slices over the data axes only, replicated parameters
    beside them over the tensor axis too); for a plain model over `group` (default world).
    """
    module = model_or_engine
    if _is_engine(model_or_engine):
        zero = state_of(cast(TrainingEngine, model_or_engine))
        zero.runtime.finish_gathers()  # the last step's, still in flight (overlap_comm)
        if zero.sharding.shard_parameters:
            raise ValueError("check_weight_sync: at ZeRO stage 3 each rank holds a shard of the parameters; "
                             "nothing is replicated to compare")
        return _check_engine_weights(zero, raise_on_mismatch=raise_on_mismatch, atol=atol, buffers=buffers)
    named: Named = [(n, p.numel(), p.detach()) for n, p in module.named_parameters()]
    if buffers:
        named += [(n, b.numel(), b) for n, b in module.named_buffers()]
    params = compare_replicated(named, group, atol=atol)
    what = "parameters and buffers" if buffers else "parameters"
    report = SyncReport(what, "compared " + _how(atol), tuple(group_ranks(group)), params)
    if not report.ok:
        logger.warning("check_weight_sync: %s", report.format())
        if raise_on_mismatch:
            raise WeightSyncError(report, "check_weight_sync")
    return report
