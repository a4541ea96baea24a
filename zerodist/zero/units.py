"""Units: the modules whose parameters are gathered together, and their lifecycle.

    SHARDED --start_unshard()--> GATHERING --finish_unshard()--> UNSHARDED --reshard()--> SHARDED

A unit is a module whose parameters (in one or more flat groups, one per optimizer param group and
domain: plan.py) are all-gathered together: by default each `nn.ModuleList` item holding at least
5% of the parameters (a transformer block), or the classes named in
`zerodist.stage3_unit_classes`; the root unit holds every parameter outside them. The plan makes
the same units at every stage ([Note: one plan for every stage] in plan.py); the unit runtime
(runtime.py) gathers them at stage 3 and waits for their post-step gathers at stages 1/2.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch

from zerodist.zero.flat_group import FlatParamGroup

DEFAULT_UNIT_FRACTION = 0.05


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
        # bytes of the unit's parameters when gathered (the runtime's gathered-bytes counter)
        self.nbytes = sum(g.layout.total_numel * g.param_dtype.itemsize for g in groups)

    def start_unshard(self) -> None:
        """Issue the all-gathers (async); a unit without parameters is gathered at once."""
        assert self.state is UnitState.SHARDED, f"unit {self.name}: start_unshard while {self.state.value}"
        for group in self.groups:
            group.start_unshard()
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight; the parameters stay placeholders until `finish_unshard`."""
        for group in self.groups:
            group.wait_unshard()

    def finish_unshard(self) -> None:
        assert self.state is UnitState.GATHERING, f"unit {self.name}: finish_unshard while {self.state.value}"
        for group in self.groups:
            group.finish_unshard()
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
