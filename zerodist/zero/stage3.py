"""ZeRO stage 3: parameters sharded across ranks, gathered per module unit around its use.

    forward:  pre-hook   unit SHARDED -> all-gather -> UNSHARDED (and prefetch the next units)
              post-hook  UNSHARDED -> SHARDED (not the root, not a unit kept for its backward:
                         [Note: reuse between forward and backward]), arm a backward pre-hook
    backward: pre-hook   (first gradient reaching the unit's outputs) gather again if freed, prefetch
              the unit's gradients complete (bucket full) -> reduce-scatter -> reshard
    end of backward: everything still gathered (the root, units with unused parameters) reshards

A unit is a module whose parameters are gathered together (by default each `nn.ModuleList`
item holding at least 5% of the parameters, e.g. each transformer block); the root unit holds
every parameter outside them and stays gathered from its forward to the end of backward.
All hooks go through PyTorch's own registration API; no attribute is set on any module or
parameter. Which parameter belongs to which unit is kept in this module's own registry.

[Note: unit order check] Stage 3 issues collectives from hooks, so ranks whose control flow
differs (a block run twice on one rank, an early exit) would pair different collectives and
hang (gloo aborts the process when the sizes differ). Before each batch of gathers (a hook's
own unit and the units it prefetches) every rank exchanges a fingerprint (what, which unit, how
many times, which batch) in one tiny all-gather; the first divergence in the gathers is therefore
always at a fingerprint exchange, which then raises on every rank naming the unit and what each
rank did. The gradient reductions need no exchange: they run on a process group of their own
([Note: gradient groups] in zerodist/comm/topology.py), where the reducer issues them in one
fixed order whatever the gathers do. At each optimizer step the ranks also compare which
units' forwards ran since the last step, in which order (`RunCheck`, digests carried by the
step's one all-reduce): a divergence that moved no data (everything already gathered) is named
there instead of passing silently.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import zerodist.comm as comm
from zerodist.zero import sharded_access
from zerodist.zero.bucket import Bucket
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.saved_params import SavedParameterViews

DEFAULT_UNIT_FRACTION = 0.05


class Stage3ControlFlowError(RuntimeError):
    """Ranks ran different units, or in a different order (see [Note: unit order check])."""


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Unit:
    """One module whose parameters (in one or more flat groups) are gathered together."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, groups: list[FlatParamGroup]):
        self.index, self.name, self.module, self.groups = index, name or "<root>", module, groups
        self.state = UnitState.SHARDED
        self.numel = sum(g.layout.total_numel for g in groups)
        self._handles: list[list[comm.CommHandle]] = []

    def start_unshard(self) -> None:
        """Issue the all-gathers (async); a unit without parameters is gathered at once."""
        assert self.state is UnitState.SHARDED, f"unit {self.name}: start_unshard while {self.state.value}"
        self._handles = [g.start_unshard() for g in self.groups]
        self.state = UnitState.GATHERING

    def wait_gathers(self) -> None:
        """Wait for the all-gathers in flight; the parameters stay placeholders until `finish_unshard`."""
        for handles in self._handles:
            for handle in handles:
                handle.wait()

    def finish_unshard(self) -> None:
        assert self.state is UnitState.GATHERING, f"unit {self.name}: finish_unshard while {self.state.value}"
        for group, handles in zip(self.groups, self._handles):
            group.finish_unshard(handles)
        self._handles = []
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        if self.state is UnitState.GATHERING:
            self.finish_unshard()
        if self.state is UnitState.UNSHARDED:
            for group in self.groups:
                group.reshard()
            self.state = UnitState.SHARDED


def select_unit_modules(model: torch.nn.Module, unit_classes: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
    """The unit modules, outermost first in `modules()` order; a unit never contains another."""
    classes = set(unit_classes)
    total = sum(p.numel() for p in model.parameters())
    list_items = {id(child) for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m}
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        if classes:
            picked = type(module).__name__ in classes
        else:
            numel = sum(p.numel() for p in module.parameters())
            picked = id(module) in list_items and numel >= DEFAULT_UNIT_FRACTION * total and numel > 0
        if picked:
            chosen.append((name, module))
    return chosen


class _OrderCheck:
    """Fingerprint exchange before stage-3 collectives ([Note: unit order check])."""

    KINDS = ("gather for forward", "gather for backward")

    def __init__(self, units: list[Unit], group: Any, enabled: bool, device: torch.device):
        self.units, self.group, self.enabled, self.device = units, group, enabled, device
        self.counts: dict[tuple[int, int], int] = {}

    def __call__(self, kind: int, unit: Unit, batch: list[Unit] | None = None) -> None:
        """Every rank is about to issue `kind` for `unit` (and gathers for the rest of `batch`):
        one 5-number all-gather; raises on every rank if any rank would do something else."""
        if not self.enabled:
            return
        batch = batch or [unit]
        digest = 0
        for member in batch:  # "time": how often this rank has done `kind` for the unit, prefetches included
            key = (kind, member.index)
            self.counts[key] = self.counts.get(key, 0) + 1
            digest = (digest * 1_000_003 + member.index + 1) % (1 << 61)
        rows = self._exchange([kind, unit.index, self.counts[(kind, unit.index)], len(batch), digest])
        if any(row != rows[0] for row in rows):
            did = "; ".join(
                f"rank {rank} would {self.KINDS[k]} unit '{self.units[u].name}' (time {c})"
                + (f" with {n - 1} more unit(s) prefetched" if n > 1 else "")
                for rank, (k, u, c, n, _) in zip(self._ranks(), rows)
            )
            raise Stage3ControlFlowError(
                f"ZeRO-3 ranks diverged: {did}. Every rank must run the same units the same number of times "
                "in the same order (same control flow); make data-dependent branches agree across ranks."
            )

    def _exchange(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        size = comm.get_world_size(self.group)
        everyone = torch.empty(len(row) * size, dtype=torch.int64, device=mine.device)
        comm.all_gather(everyone, mine, group=self.group)
        return everyone.view(size, len(row)).tolist()

    def _ranks(self) -> list[int]:
        return [comm.get_global_rank(self.group, r) for r in range(comm.get_world_size(self.group))]


class RunCheck:
    """Which units' forwards ran since the last optimizer step, in which order: compared across
    ranks inside the step's one all-reduce (`ZeroOptimizer.step_checks`), so a divergence that
    moved no data (everything already gathered) is named too ([Note: unit order check])."""

    _KEEP = 10_000  # runs remembered for the message; the digests cover them all

    def __init__(self, units: list[Unit], group: Any):
        self.units, self.group = units, group
        self.runs: list[int] = []
        self.count = 0
        self._digests = [0, 0]

    def record(self, unit: Unit) -> None:
        self.count += 1
        if len(self.runs) < self._KEEP:
            self.runs.append(unit.index)
        # two independent 20-bit digests: their squares stay exact when summed in float64
        self._digests[0] = (self._digests[0] * 1_000_003 + unit.index + 1) % 1_048_573
        self._digests[1] = (self._digests[1] * 999_983 + self.count * (unit.index + 7)) % 1_048_571

    def digests(self) -> list[int]:
        return [*self._digests, self.count % 1_048_573]

    def reset(self) -> None:
        self.runs, self.count, self._digests = [], 0, [0, 0]

    def explain(self) -> None:
        """Every rank found the digests differ: exchange the runs and raise, naming them."""
        everyone: list[Any] = [None] * comm.get_world_size(self.group)
        comm.all_gather_object(everyone, (self.count, self.runs), group=self.group)
        described = []
        for rank, (count, sequence) in enumerate(everyone):
            counts: dict[int, int] = {}
            for index in sequence:
                counts[index] = counts.get(index, 0) + 1
            listed = ", ".join(f"'{self.units[i].name}' x{n}" for i, n in sorted(counts.items()))
            order = " -> ".join(f"'{self.units[i].name}'" for i in sequence[:50])
            more = f" ({count - 50} more)" if count > 50 else ""
            described.append(f"rank {comm.get_global_rank(self.group, rank)} ran {listed} "
                             f"(in order {order}{more})")
        self.reset()
        raise Stage3ControlFlowError(
            "ZeRO-3 ranks diverged since the last optimizer step: " + "; ".join(described) + ". Every rank "
            "must run the same units the same number of times in the same order (same control flow); make "
            "data-dependent branches agree across ranks."
        )


# parameter -> weak (runtime or None, unit or None, group): zerodist's own bookkeeping, never on
# the parameter. Replicated parameters (stages 0-2, stage 3's persistent ones) have no unit.
# The values are weak too: a group holds its parameters, so a strong value would keep its own key
# (and every buffer of a destroyed engine) alive forever.
_REGISTRY: WeakIdKeyDictionary[torch.Tensor, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = (
    WeakIdKeyDictionary()
)


def _weak(obj: Any) -> Callable[[], Any]:
    return (lambda: None) if obj is None else weakref.ref(obj)


def _lookup(param: torch.Tensor) -> tuple[Stage3Runtime | None, Unit | None, FlatParamGroup] | None:
    entry = _REGISTRY.get(param)
    if entry is None:
        return None
    runtime, unit, group = (ref() for ref in entry)
    return None if group is None else (runtime, unit, group)


def register_replicated(groups: list[FlatParamGroup], runtime: Stage3Runtime | None = None) -> None:
    """Record parameters whose values every rank holds, so GatheredParameters can publish changes."""
    for group in groups:
        for param in group.params:
            _REGISTRY[param] = (_weak(runtime), _weak(None), _weak(group))


def _unchecked(method: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(method)
    def unchecked(*args: Any, **kwargs: Any) -> None:
        with sharded_access.suspended():
            method(*args, **kwargs)
    return unchecked


@dataclasses.dataclass(frozen=True)
class Stage3Settings:
    """What the runtime takes from the config (`from_config`)."""

    prefetch_numel: int  # zero_optimization.stage3_prefetch_bucket_size
    max_live_numel: int  # zero_optimization.stage3_max_live_parameters
    max_reuse_numel: int  # zero_optimization.stage3_max_reuse_distance
    order_check: bool  # zerodist.debug.unit_order_check
    access_check: bool  # zerodist.debug.sharded_access_check

    @classmethod
    def from_config(cls, config: Any) -> Stage3Settings:
        zero, debug = config.zero_optimization, config.zerodist.debug
        return cls(zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance,
                   debug.unit_order_check, debug.sharded_access_check)


class Stage3Runtime:
    """Hooks, prefetch, reuse and live-memory bound for the units of one model.

    [Note: reuse between forward and backward] A unit's backward comes soon after its forward
    when few parameters are used in between: the last units of the forward are the first of
    the backward. As DeepSpeed's `stage3_max_reuse_distance`, a unit stays gathered from its
    forward to its backward when fewer elements than that distance are used in between (twice
    the units after it: their forward and their backward), and while the root, the kept units
    and the largest other unit fit in `stage3_max_live_parameters`. Which units are kept is
    decided once, from the forward order, so it is the same on every rank. With every unit kept
    no gather happens in backward.
    """

    def __init__(self, model: torch.nn.Module, units: list[Unit], root: Unit, persistent: list[FlatParamGroup], *,
                 settings: Stage3Settings, group: Any, device: torch.device):
        self.model, self.units, self.root, self.persistent = model, units, root, persistent
        self.order = [u for u in units if u is not root]  # forward order of the non-root units
        self.prefetch_numel, self.max_live_numel = settings.prefetch_numel, settings.max_live_numel
        self.kept = self._units_kept(settings.max_reuse_numel)
        self.check = _OrderCheck(units, group, settings.order_check, device)
        self.live_numel = 0
        self.peak_live_numel = 0
        self.runs = RunCheck(units, group)
        self._early: list[Unit] = []  # issued by step() for the next forward ([Note: early gather])
        self._bucket_owner = {id(b): u for u in units for g in u.groups for b in g.buckets}
        self._handles = [root.module.register_forward_pre_hook(self._pre_forward_root)]
        for unit in self.order:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
            if unit.index not in self.kept:  # freed after forward: [Note: saved parameter views]
                views = SavedParameterViews(self, unit)  # its pre-hook runs after the gather above
                self._handles.append(unit.module.register_forward_pre_hook(lambda _m, _a, v=views, u=unit: v.enter(u)))
                self._handles.append(unit.module.register_forward_hook(lambda _m, _a, _o, v=views: v.leave(),
                                                                       always_call=True))
        for unit in units:
            for group_ in unit.groups:
                for param in group_.params:
                    _REGISTRY[param] = (_weak(self), _weak(unit), _weak(group_))
                if settings.access_check:
                    group_.enable_access_check()
        register_replicated(persistent, self)

    def _units_kept(self, max_reuse_numel: int) -> set[int]:
        """The indices of the units that stay gathered from forward to backward: the longest
        tail of the forward order within the reuse distance and the live bound."""
        kept: set[int] = set()
        after = 0  # elements of the units after the candidate
        for position in range(len(self.order) - 1, -1, -1):
            unit = self.order[position]
            largest_other = max((u.numel for u in self.order[:position]), default=0)
            if 2 * after >= max_reuse_numel or self.root.numel + after + unit.numel + largest_other > self.max_live_numel:
                break
            kept.add(unit.index)
            after += unit.numel
        return kept

    # ------------------------------------------------------------------ gathering
    # Gathering and resharding run without the access check ([Note: sharded access check]): they
    # only touch gathered buffers and the check's own placeholders, and on a module called outside
    # the engine every one of their torch calls would pay for it.
    @_unchecked
    def _issue(self, units: list[Unit], kind: int) -> None:
        """Start gathering `units` (all sharded), after one fingerprint exchange for all of them."""
        moving = [u for u in units if u.groups]  # a unit without parameters moves nothing
        if moving:
            self.check(kind, moving[0], moving)
        for unit in units:
            unit.start_unshard()
            self.live_numel += unit.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    @_unchecked
    def _require(self, unit: Unit, kind: int, prefetch_step: int = 0) -> None:
        """Make `unit` gathered now, issuing its gather (if no prefetch did) together with the
        prefetch of the units after (+1) or before (-1) it."""
        batch = [unit] if unit.state is UnitState.SHARDED else []
        if prefetch_step:
            batch += self._prefetch_candidates(unit, prefetch_step, self.live_numel + sum(u.numel for u in batch))
        if batch:
            self._issue(batch, kind)
        if unit.state is UnitState.GATHERING:
            unit.finish_unshard()

    def _prefetch_candidates(self, unit: Unit, step: int, live: int) -> list[Unit]:
        """The units after (step=+1) or before (step=-1) `unit` (the root: from the first) to
        gather ahead, within the prefetch budget and the live-parameter bound."""
        budget, chosen = self.prefetch_numel, []
        index = 0 if unit is self.root else self.order.index(unit) + step
        while 0 <= index < len(self.order):
            candidate = self.order[index]
            if candidate.state is UnitState.SHARDED:
                if candidate.numel > budget or live + candidate.numel > self.max_live_numel:
                    break
                chosen.append(candidate)
                budget -= candidate.numel
                live += candidate.numel
            index += step
        return chosen

    # [Note: early gather] Nothing precedes the first units' gathers in a forward: the root's
    # pre-hook would issue them and wait at once. With overlap_comm, `ZeroOptimizer.step()` issues
    # right after the shards are updated exactly what that pre-hook would (the root and its
    # prefetch, one fingerprint exchange of kind 0: every rank steps, so every rank does the same),
    # and the pre-hook only waits. Until then the units are GATHERING: their parameters stay
    # placeholders (the access check refuses reads). `finish_early_gathers` waits for their
    # collectives, leaving them GATHERING (local: for entry points that may run on one rank only,
    # and the access check answers as with overlap off); `drop_early_gathers` also frees
    # them (collective use only: the next forward gathers them again) where the shards may change
    # (another step, a load, GatheredParameters) or the engine is destroyed.
    def start_early_gathers(self) -> None:
        """Issue the next forward's first gathers now (after a step; nothing may be gathered early)."""
        assert not self._early, "start_early_gathers twice without a forward or a drop"
        batch = [self.root] if self.root.state is UnitState.SHARDED else []
        batch += self._prefetch_candidates(self.root, +1, self.live_numel + sum(u.numel for u in batch))
        if batch:
            self._issue(batch, 0)
        self._early = batch

    def finish_early_gathers(self) -> None:
        """Wait for the early gathers still in flight (no collective: any rank may call it alone);
        the units stay GATHERING, their parameters placeholders, until the forward's pre-hooks."""
        for unit in self._early:
            if unit.state is UnitState.GATHERING:
                unit.wait_gathers()

    def drop_early_gathers(self) -> None:
        """Wait for and free the units gathered early; every rank must call it together."""
        early, self._early = self._early, []
        for unit in early:
            self._release(unit)

    @_unchecked
    def _release(self, unit: Unit) -> None:
        if unit.state is not UnitState.SHARDED:
            unit.reshard()
            self.live_numel -= unit.numel

    # ------------------------------------------------------------------ hooks
    def _record_run(self, unit: Unit) -> None:
        if torch.is_grad_enabled():  # a forward that a backward (and a step) may follow
            self.runs.record(unit)

    def _pre_forward_root(self, module: torch.nn.Module, args: Any) -> None:
        self._record_run(self.root)
        if self._early:  # step() issued this forward's first gathers ([Note: early gather]): only wait
            self._early = []
            self._require(self.root, 0)
        else:
            self._require(self.root, 0, prefetch_step=+1)

    def _make_pre_forward(self, unit: Unit):
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            self._record_run(unit)
            self._require(unit, 0, prefetch_step=+1)
        return pre_forward

    def _make_post_forward(self, unit: Unit):
        def post_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            backward_follows = bool(tensors) and torch.is_grad_enabled()
            if not (backward_follows and unit.index in self.kept):
                self._release(unit)
            if backward_follows:
                # Weak: the hook lives on the outputs' autograd nodes, which a module may keep (MoE
                # layers keep gate outputs); a strong closure there would keep this runtime and its
                # shards alive through a cycle Python's collector cannot see (it runs through C++).
                runtime, unit_ref = weakref.ref(self), weakref.ref(unit)
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(_pre_backward_hook, runtime, unit_ref), mode="any")
        return post_forward

    def _pre_backward(self, unit: Unit) -> None:
        self._require(unit, 1, prefetch_step=-1)

    def on_bucket_complete(self, bucket: Bucket) -> None:
        """A unit's gradients are all in: its parameters are no longer needed in this backward."""
        unit = self._bucket_owner.get(id(bucket))
        if unit is not None and unit is not self.root and all(b.is_complete for g in unit.groups for b in g.buckets):
            self._release(unit)

    def end_backward(self) -> None:
        for unit in self.units:
            self._release(unit)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _owners(params: Iterable[torch.Tensor]) -> list[tuple[Any, Unit | None, FlatParamGroup, torch.Tensor]]:
    found = []
    for param in params:
        entry = _lookup(param)
        if entry is not None:
            found.append((*entry, param))
    return found


def is_sharded(param: torch.Tensor) -> bool:
    """Whether `param` is a ZeRO-3 parameter currently without its values (outside a gather):
    using its data then raises `ShardedParameterError` ([Note: sharded access check])."""
    entry = _lookup(param)
    return entry is not None and entry[1] is not None and entry[1].state is not UnitState.UNSHARDED


def full_shape(param: torch.Tensor) -> torch.Size:
    """The logical (unsharded) shape of a parameter, gathered or not. A sharded parameter keeps
    this shape ([Note: sharded placeholder]), so `param.shape`, `param.numel()` and the like
    agree and stay allowed; its values need a gather (`GatheredParameters`)."""
    return param.shape


class GatheredParameters:
    """Full parameters inside the block, on every rank (all ranks must enter it together).

    With `modifier_rank=r`, rank r's changes made inside the block are broadcast on exit and
    partitioned again (master weights included); otherwise changes are discarded.

        with zerodist.zero.GatheredParameters(model.head.weight, modifier_rank=0):
            if rank == 0:
                model.head.weight.zero_()
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered: list[tuple[Stage3Runtime, Unit]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        units: dict[int, tuple[Stage3Runtime, Unit]] = {}
        owners = _owners(self.params)
        for runtime in {id(r): r for r, _, _, _ in owners if r is not None}.values():
            runtime.drop_early_gathers()  # its changes, or their discarding, must reach every unit ([Note: early gather])
        for runtime, unit, group, _ in owners:
            group.finish_gather_params()  # stages 1/2: the last step's gather ([Note: overlapped parameter gather])
            if unit is not None and unit.state is not UnitState.UNSHARDED:
                units.setdefault(id(unit), (runtime, unit))
        self._gathered = sorted(units.values(), key=lambda ru: ru[1].index)
        for runtime, unit in self._gathered:
            runtime._require(unit, 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                self._publish_changes()
        for runtime, unit in self._gathered:
            runtime._release(unit)
        self._gathered = []

    def _publish_changes(self) -> None:
        groups = {id(g): g for _, _, g, _ in _owners(self.params)}
        for group in groups.values():
            assert group.param_buffer is not None, "a gathered group has its full buffer"
            # a group of a strict-subgroup domain takes the changes of its member standing where the
            # modifier stands (each expert group publishes its own expert's)
            source = group.domain_group.peer_of(self.modifier_rank)
            comm.broadcast(group.param_buffer, src=source, group=group.group)
            group.take_shard_from_full()


def _pre_backward_hook(runtime: weakref.ref, unit: weakref.ref, grads: Any) -> None:
    alive, target = runtime(), unit()
    if alive is not None and target is not None:
        alive._pre_backward(target)
