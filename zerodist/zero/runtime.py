"""The unit runtime: explicit verbs that gather, free and reduce a model part's units, at every stage.

    unshard(units)      issue the all-gathers of the units that are sharded (async)
    wait_unshard(units) wait for them: the parameters hold their full values
    reshard(units)      free the full buffers again (sharded parameters)
    reduce_gradients()  reduce the gradients accumulated locally, now, once

[Note: one gather verb] Every all-gather of parameters is an unshard, whatever the stage:
- stage 3: a unit's shards into a transient full buffer, around its forward and its backward;
- stages 1/2 (and stage 3's persistent groups): after each optimizer step the full buffer is
  stale (only this rank's shard was stepped), so the units count as sharded until the updated
  shards are gathered into it, in place; `reshard` has nothing to free there;
- stage 0: every rank steps the full buffer; units are never sharded.
`FlatParamGroup.start_unshard / wait_unshard / finish_unshard / reshard` do this per group,
`Unit` per unit (units.py), and this runtime per model part, with the order checks, the
prefetch, the reuse and live-memory bounds.

Who calls the verbs is a schedule. The default schedule (schedule.py) calls them from module
hooks at the moments DeepSpeed's ZeRO does (forward pre/post, backward pre, bucket complete,
optimizer step), so results are bitwise those of the hooks before this runtime existed. A caller
can drive them instead ([Note: driving the runtime]).

[Note: driving the runtime] Inside `with runtime.driven():` the hooks still gather what is
sharded when a unit runs, but prefetch nothing and free nothing, and backward accumulates every gradient locally in
full-size buffers instead of reducing it (the gradient reducer defers: reducer.py). The caller
decides when: a pipeline schedule unshards a part's units once, runs several micro-batches'
forwards and backwards, then calls `reduce_gradients()` once and `reshard()`. At stages 2/3
that trades memory (a full gradient buffer per unit, as stages 0/1 always keep) for one
gradient reduction and one gather per unit per batch instead of one per micro-batch; the sums
are those of stages 0/1's local accumulation, bitwise. The optimizer step reduces what is still
deferred and frees every unit it finds gathered first (its shards are about to change).

[Note: overlapped parameter gather] After the optimizer steps its shards, every rank's updated
shards must reach every rank before the parameters are read again. the step's post-hook issues each flat
group's all-gathers asynchronously (same collectives, same order, same data as a synchronous
gather: the results are bitwise the same), and the next forward waits for a group only where it
first needs it:

    step()              optimizer on the shards -> start every group's all-gather (no wait)
    forward pre-hook    root module: wait for the root unit's and the persistent groups
    forward pre-hook    unit k (a transformer block): wait for unit k's groups
                        -> blocks 0..k-1 compute while blocks k.. are still being gathered

The units and groups are the plan's ([Note: one plan for every stage] in plan.py): a group holds
the parameters of one unit (or the root, or the persistent ones), so a unit's pre-hook knows what
it needs. Everything else that reads or writes parameters waits first: the engine's other entry
points (backward too: a graph retained from before the step reads the saved parameters) and the
next `step()` call `finish_gathers()`, `GatheredParameters` finishes its parameters' groups,
and user code between `step()` and the next forward (`print(model.fc.weight.sum())`,
`torch.save(model.state_dict())`) is made to wait by the access check, which is on the torch-function
mode stack while a gather is pending ([Note: parameters being gathered] in sharded_access.py).
The engine's forward keeps that mode on while a gather is pending (`suspended(waiting=True)`), so a
forward that reads a unit's parameters before that unit's pre-hook ran waits for them too; it costs
a few microseconds per torch call of that forward until the last unit's pre-hook has waited, which
takes the idle mode off the stack (`sharded_access.settle()`), and nothing when no gather is pending.

Groups are issued in the order the forward waits for them, root and persistent first: gloo
completes one process group's collectives in issue order, so a group issued last but waited for
first would hold up the forward until every gather had landed. Stage 3's persistent groups (full
parameters, sharded optimizer state) are gathered the same way; its units gather themselves, and
the step's post-hook issues the next forward's first units after these groups ([Note: early gather]).

`overlap_comm: false` waits for every group at the end of `step()`, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from zerodist.comm import timeline
from zerodist.comm.collectives import Group

from zerodist.zero import sharded_access
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.reducer import GradReducer
from zerodist.zero.registry import register_replicated, register_unit_params
from zerodist.zero.unit_checks import RunCheck, UnitOrderCheck
from zerodist.zero.units import Unit, UnitState

FORWARD, BACKWARD = 0, 1  # what a gather is for, in the order check's fingerprint


@dataclasses.dataclass(frozen=True)
class UnitSettings:
    """What the runtime takes from the config (built by `ZeroSettings.from_config`, settings.py)."""

    prefetch_numel: int  # zero_optimization.stage3_prefetch_bucket_size
    max_live_numel: int  # zero_optimization.stage3_max_live_parameters
    max_reuse_numel: int  # zero_optimization.stage3_max_reuse_distance
    order_check: bool  # zerodist.debug.unit_order_check
    access_check: bool  # zerodist.debug.sharded_access_check
    overlap: bool = True  # zero_optimization.overlap_comm: post-step gathers waited for at first use


def _unchecked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Gathering and resharding run without the access check ([Note: sharded access check]): they
    only touch gathered buffers and the check's own placeholders, and on a module called outside
    the engine every one of their torch calls would pay for it."""
    @functools.wraps(method)
    def unchecked(*args: Any, **kwargs: Any) -> Any:
        with sharded_access.suspended():
            return method(*args, **kwargs)
    return unchecked


class UnitRuntime:
    """The units of one model part (root first), its persistent groups, and the verbs on them.

    [Note: reuse between forward and backward] A unit's backward comes soon after its forward
    when few parameters are used in between: the last units of the forward are the first of
    the backward. As DeepSpeed's `stage3_max_reuse_distance`, a unit stays gathered from its
    forward to its backward when fewer elements than that distance are used in between (twice
    the units after it: their forward and their backward), and while the root, the kept units
    and the largest other unit fit in `stage3_max_live_parameters`. Which units are kept is
    decided once, from the forward order, so it is the same on every rank. With every unit kept
    no gather happens in backward.
    """

    def __init__(self, units: list[Unit], persistent: list[FlatParamGroup], reducer: GradReducer, *,
                 shard_parameters: bool, settings: UnitSettings, group: Group, device: torch.device):
        self.units, self.root, self.persistent, self.reducer = units, units[0], persistent, reducer
        self.order = units[1:]  # forward order of the non-root units
        self.shards_parameters = shard_parameters  # the sharding policy's (stage 3), whatever the units hold
        self.prefetch_numel, self.max_live_numel = settings.prefetch_numel, settings.max_live_numel
        self.overlap = settings.overlap
        self.kept = self._units_kept(settings.max_reuse_numel) if self.shards_parameters else set()
        self.check = UnitOrderCheck(units, group, settings.order_check, device)
        self.runs = RunCheck(units, group)
        self.live_numel = 0
        self.peak_live_numel = 0
        # parameter bytes gathered by `unshard` and not yet freed (stage 3), and their high-water mark
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.driving = False  # inside `driven()`: [Note: driving the runtime]
        # False when a caller's schedule gathers every unit when it needs it (a pipeline's UNSHARD
        # actions): the step then issues no early gathers ([Note: early gather]), which it would drop unused
        self.early_gathers = True
        self._early: list[Unit] = []  # issued after a step for the next forward ([Note: early gather])
        self._bucket_owner = {id(b): u for u in units for g in u.groups for b in g.buckets}
        # Units holding frozen groups, and those of them whose forward inputs' gradients are still to
        # come in this backward ([Note: frozen parameters at stage 3] in apply.py)
        self.frozen_units = {u.index for u in units if any(not g.trainable for g in u.groups)}
        self._awaiting_inputs: set[int] = set()
        self._grads_in: set[int] = set()  # units whose gradients all arrived in this backward
        # The unit last recomputed inside a backward pass (activation checkpointing) and kept gathered
        # for its backward, which has not started yet (`hold_recomputed`)
        self._recomputed: Unit | None = None
        # The post-step gathers of full parameters ([Note: overlapped parameter gather]), by the unit whose
        # forward pre-hook waits for them: the root waits for its own and the persistent ones.
        self.gathers_by_unit: dict[int, list[FlatParamGroup]] = {}
        for index, groups in [*((u.index, u.groups) for u in units), (0, persistent)]:
            gathering = [g for g in groups if g.gathers_params]
            if gathering:
                self.gathers_by_unit.setdefault(index, []).extend(gathering)
        self.gather_groups = [g for index in sorted(self.gathers_by_unit) for g in self.gathers_by_unit[index]]
        if not self.shards_parameters:
            for unit in units:
                unit.state = UnitState.UNSHARDED  # full parameters: never sharded ([Note: one gather verb])
        if self.shards_parameters:
            reducer.on_complete = self.on_bucket_complete
            register_unit_params(self, units)
            if settings.access_check:
                for unit in units:
                    for flat in unit.groups:
                        flat.enable_access_check()
            register_replicated(persistent, self)
        else:
            register_replicated([g for u in units for g in u.groups] + persistent)

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

    # ------------------------------------------------------------------ the verbs
    @_unchecked
    def unshard(self, units: Sequence[Unit] | None = None, *, kind: int = FORWARD) -> None:
        """Issue the all-gathers of those of `units` (default: every unit) that are sharded, after
        one fingerprint exchange for all of them ([Note: unit order check]); collective. Full
        parameters (stages 0-2) are gathered after each step only (`after_step`)."""
        batch = [u for u in (self.units if units is None else units) if u.state is UnitState.SHARDED]
        moving = [u for u in batch if u.groups]  # a unit without parameters moves nothing
        if moving:
            self.check(kind, moving[0], moving)
        self._read_offloaded_shards(batch)
        for unit in batch:
            unit.start_unshard()
            self.live_numel += unit.numel
            self.live_bytes += unit.nbytes
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    @staticmethod
    def _read_offloaded_shards(batch: Sequence[Unit]) -> None:
        """Offloaded shards ([Note: stepped values elsewhere] in stepped_store.py): read them all
        before any gather is issued, and agree on failure, so that a read failing on one rank is the
        same error on every rank instead of a hang in the all-gather. Every rank has the same batch."""
        offloaded = [g for unit in batch for g in unit.groups if g.shard_offloaded]
        if not offloaded:
            return
        failure: Exception | None = None
        try:
            for group in offloaded:
                group.prepare_unshard()
        except Exception as error:  # noqa: BLE001 - handed to the store, which raises it on every rank
            failure = error
        store = offloaded[0].stepped_store
        assert store is not None
        try:
            store.agree(failure)
        except BaseException:
            for group in offloaded:  # no later gather may start from a buffer read before the failure
                group.drop_prepared_unshard()
            raise

    def wait_unshard(self, units: Sequence[Unit] | None = None) -> None:
        """Wait for the gathers of `units` (default: every unit) in flight, sharded parameters' and
        the last step's of full ones (the root's include the persistent groups'); their
        parameters then hold the full values. No collective: any rank may call it alone."""
        for unit in self.units if units is None else units:
            if unit.state is UnitState.GATHERING:
                self._finish(unit)
            for group in self.gathers_by_unit.get(unit.index, ()):
                group.wait_unshard()

    @_unchecked
    def _finish(self, unit: Unit) -> None:
        unit.finish_unshard()

    @_unchecked
    def reshard(self, units: Sequence[Unit] | None = None) -> None:
        """Free the full buffers of those of `units` (default: every unit) that are gathered
        (sharded parameters; full ones have nothing to free)."""
        if not self.shards_parameters:
            return
        for unit in self.units if units is None else units:
            if unit.state is not UnitState.SHARDED:
                unit.reshard()
                self.live_numel -= unit.numel
                self.live_bytes -= unit.nbytes

    def reset_peak(self) -> None:
        """Start the gathered high-water marks (`peak_live_numel`, `peak_live_bytes`) from what is
        gathered now."""
        self.peak_live_numel, self.peak_live_bytes = self.live_numel, self.live_bytes

    def reduce_gradients(self) -> None:
        """Reduce the gradients backward accumulated without reducing ([Note: driving the
        runtime]), now; collective. Nothing to do when none are deferred."""
        self.reducer.reduce_deferred()

    @contextlib.contextmanager
    def driven(self) -> Iterator[UnitRuntime]:
        """The caller drives the verbs ([Note: driving the runtime]); on leaving, the hooks free
        units and reduce gradients themselves again. Every rank must enter it together."""
        assert not self.driving, "runtime.driven() is not reentrant"
        self.driving, self.reducer.deferring = True, True
        try:
            yield self
        finally:
            self.driving, self.reducer.deferring = False, False

    # ------------------------------------------------------------------ for the schedule
    def gather_for(self, unit: Unit, kind: int, prefetch_step: int = 0) -> None:
        """Make `unit` gathered now: issue its gather (if no prefetch did) together with the
        prefetch of the units after (+1) or before (-1) it, and wait for it."""
        began = timeline.mark()  # [Note: timeline cost] in zerodist/comm/timeline.py
        batch = [unit] if unit.state is UnitState.SHARDED else []
        if prefetch_step and not self.driving:  # a driving caller gathers ahead itself (a pipeline's UNSHARDs)
            batch += self._prefetch_candidates(unit, prefetch_step, self.live_numel + sum(u.numel for u in batch))
        if batch:
            self.unshard(batch, kind=kind)
        self.wait_unshard([unit])
        timeline.finish(began, "zero", "gather unit", unit=unit.index, issued=len(batch))

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

    def release(self, unit: Unit) -> None:
        """The default schedule is done with `unit` (after its forward, or its gradients): free it,
        unless a caller drives the runtime."""
        if not self.driving:
            self.reshard([unit])

    def on_bucket_complete(self, bucket: Any) -> None:
        """A unit's gradients are all in: its parameters are no longer needed in this backward
        (with frozen groups: once its inputs' gradients are in too)."""
        unit = self._bucket_owner.get(id(bucket))
        if unit is not None and all(b.is_complete for g in unit.groups for b in g.buckets):
            self._grads_in.add(unit.index)  # the buckets reset once reduced: remembered for `inputs_done`
            self._release_if_done(unit)

    def await_inputs(self, unit: Unit) -> None:
        """A forward of `unit`, which holds frozen groups, took inputs that need gradients: the
        backward through its frozen weights is done only when theirs are (`inputs_done`)."""
        self._awaiting_inputs.add(unit.index)

    def inputs_done(self, unit: Unit) -> None:
        """The gradients of `unit`'s forward inputs are in: nothing in this backward reads its
        frozen weights any more."""
        self._awaiting_inputs.discard(unit.index)
        self._release_if_done(unit)

    def _release_if_done(self, unit: Unit) -> None:
        trained_in = unit.index in self._grads_in or not any(g.buckets for g in unit.groups)
        if unit is not self.root and unit.index not in self._awaiting_inputs and trained_in:
            self.release(unit)

    def hold_recomputed(self, unit: Unit) -> bool:
        """`unit`'s forward ran inside a backward pass (an activation-checkpoint recompute): keep it
        gathered for its own backward, which comes next, instead of freeing it and gathering it
        again. Only the last such unit is held: in a region of several units, all recompute before
        any of their backwards (the last one's runs first), so an earlier one still held (its
        backward not started) is freed now and gathered again for its backward, as without this.
        Not beyond stage3_max_live_parameters. False: free `unit` as after any forward."""
        previous, self._recomputed = self._recomputed, None
        if previous is not None and previous is not unit:
            self.release(previous)
        if self.live_numel > self.max_live_numel:
            return False
        self._recomputed = unit
        return True

    def backward_started(self, unit: Unit) -> None:
        """`unit`'s backward began: if it was held after a recompute, its gradients free it now."""
        if self._recomputed is unit:
            self._recomputed = None

    def end_backward(self) -> None:
        self._recomputed = None
        self._awaiting_inputs.clear()
        self._grads_in.clear()
        for unit in self.units:
            self.release(unit)

    # [Note: early gather] Nothing precedes the first units' gathers in a forward: the root's
    # pre-hook would issue them and wait at once. With overlap_comm, the step's post-hook issues
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
            self.unshard(batch, kind=FORWARD)
        self._early = batch

    def take_early_gathers(self) -> bool:
        """The forward that the early gathers were for has begun: True if there were any."""
        early, self._early = self._early, []
        return bool(early)

    def finish_early_gathers(self) -> None:
        """Wait for the early gathers still in flight (no collective: any rank may call it alone);
        the units stay GATHERING, their parameters placeholders, until the forward's pre-hooks."""
        for unit in self._early:
            if unit.state is UnitState.GATHERING:
                unit.wait_unshard()

    def drop_early_gathers(self) -> None:
        """Wait for and free the units gathered early; every rank must call it together."""
        early, self._early = self._early, []
        self.reshard(early)

    # ------------------------------------------------------------------ around the optimizer step
    @property
    def pending(self) -> list[FlatParamGroup]:
        """The post-step gathers still to be waited for."""
        return [g for g in self.gather_groups if g.is_gathering_params]

    @property
    def blocked_s(self) -> float:
        """Seconds this rank was blocked waiting for the post-step gathers, over every step so far."""
        return sum(g.gather_blocked_s for g in self.gather_groups)

    def finish_gathers(self, release: bool = False) -> None:
        """Wait for the last step's parameter all-gathers still in flight: every parameter holds
        its updated values after this. `release` (every rank together, where the shards may change
        next) also frees the units gathered early, so no stale full values survive."""
        self.wait_updated()
        if release:
            self.drop_early_gathers()
        else:
            self.finish_early_gathers()

    def wait_updated(self) -> None:
        """Wait for every post-step gather of full parameters."""
        for group in self.gather_groups:
            group.wait_unshard()

    def before_step(self) -> None:
        """The shards are about to change: finish the last step's gathers, free what was gathered
        early or held by a caller, and reduce gradients still deferred; collective."""
        self.finish_gathers(release=True)
        self.reduce_gradients()
        self.reshard()
        for unit in self.units:  # hpZ's secondary copies are stale from here ([Note: secondary partition] in hpz.py)
            for group in unit.groups:
                if group.trainable:  # a frozen group's values change only through its own verbs, which drop it
                    group.storage.drop_secondary()

    def after_step(self) -> None:
        """The shards changed: the full parameters are stale until gathered again. Issue their
        gathers in the order the forward waits for them (waited for now without overlap), then,
        with overlap and sharded parameters, the next forward's first units ([Note: early gather])."""
        if self.gather_groups:
            sharded_access.finish_completed()  # other engines' done gathers: nothing left to guard there
        for group in self.gather_groups:
            group.start_unshard()
        if not self.overlap:
            self.wait_updated()
        if self.shards_parameters and self.overlap and self.early_gathers:
            self.start_early_gathers()  # after the persistent groups': the order the forward waits
