"""Stages 1-2: the updated parameters' all-gather, issued at the end of `step()`, waited at first use.

[Note: overlapped parameter gather] After the optimizer steps its shards, every rank's updated
shards must reach every rank before the parameters are read again. `step()` issues each flat
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
next `step()` call `finish()`, `GatheredParameters` finishes its parameters' groups,
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
`step()` issues the next forward's first units after these groups ([Note: early gather] in stage3.py).

`overlap_comm: false` waits for every group at the end of `step()`, as before.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from zerodist.zero import sharded_access
from zerodist.zero.flat_group import FlatParamGroup


class ParamGatherSchedule:
    """The post-step parameter all-gathers of one engine's groups, and the forward pre-hooks that
    wait for them. Hooks go through `register_forward_pre_hook`; their handles live here."""

    def __init__(self, model: torch.nn.Module | None, unit_modules: Sequence[torch.nn.Module],
                 groups: Sequence[tuple[int | None, FlatParamGroup]], *, overlap: bool):
        """`groups`: (unit, group) for every flat group, unit 0 the root (`model`), k the module
        `unit_modules[k - 1]`, None persistent. Only groups that gather parameters are kept. Without
        a model (no hooks to wait in) the gathers are waited for at once, whatever `overlap` says."""
        self.overlap = overlap and model is not None
        # unit -> its groups; the root's pre-hook also waits for the persistent ones (used everywhere)
        self.by_unit: dict[int, list[FlatParamGroup]] = {}
        for unit, group in groups:
            if group.gathers_params:
                self.by_unit.setdefault(unit or 0, []).append(group)
        # Issued in the order the forward waits: a backend completes one group's collectives in
        # issue order (gloo), so waiting for a group issued last would wait for all of them.
        self.groups = [g for unit in sorted(self.by_unit) for g in self.by_unit[unit]]
        self._handles: list[Any] = []
        if overlap and self.groups and model is not None:
            me = weakref.ref(self)  # the hooks live on the user's modules: they must not keep the groups alive
            modules = [model, *unit_modules]
            for unit in sorted(self.by_unit):
                self._handles.append(modules[unit].register_forward_pre_hook(functools.partial(_pre_forward, me, unit)))

    @property
    def pending(self) -> list[FlatParamGroup]:
        return [g for g in self.groups if g.is_gathering_params]

    @property
    def blocked_s(self) -> float:
        """Seconds this rank was blocked waiting for the gathers, over every step so far."""
        return sum(g.gather_blocked_s for g in self.groups)

    def start(self) -> None:
        """Issue every group's all-gather (root and persistent first, then unit by unit); with
        overlap off, wait for them now."""
        if self.groups:
            sharded_access.finish_completed()  # other engines' done gathers: nothing left to guard there
        for group in self.groups:
            group.start_gather_params()
        if not self.overlap:
            self.finish()

    def finish(self, unit: int | None = None) -> None:
        """Wait for every pending gather, or only unit `unit`'s (0: the root's and the persistent)."""
        for group in self.groups if unit is None else self.by_unit.get(unit, ()):
            group.finish_gather_params()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _pre_forward(schedule_ref: weakref.ref[ParamGatherSchedule], unit: int, module: torch.nn.Module,
                 args: Any) -> None:
    schedule = schedule_ref()
    if schedule is not None:
        schedule.finish(unit)
        sharded_access.settle()  # the last wait of this forward: the check has nothing more to do
