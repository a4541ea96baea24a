"""Which parameter belongs to which unit and runtime, and `GatheredParameters`.

zerodist's own bookkeeping, never on the parameter: a weak map from each flat-grouped parameter to
its runtime, its unit (None for replicated parameters: stages 0-2, stage 3's persistent ones) and
its flat group. `GatheredParameters`, `is_sharded` and `checkpoint/` look parameters up here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

import zerodist.comm as comm
from zerodist.zero import init_shards
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.units import Unit, UnitState


class UnitGatherer(Protocol):
    """What the registry and `GatheredParameters` need of a unit runtime (`UnitRuntime` in
    runtime.py; described here, not imported, so that the runtime can import the registry)."""

    def unshard(self, units: Sequence[Unit] | None = None, *, kind: int = 0) -> None: ...

    def wait_unshard(self, units: Sequence[Unit] | None = None) -> None: ...

    def reshard(self, units: Sequence[Unit] | None = None) -> None: ...

    def drop_early_gathers(self) -> None: ...


# parameter -> weak (runtime or None, unit or None, group): zerodist's own bookkeeping, never on
# the parameter. Replicated parameters (stages 0-2, stage 3's persistent ones) have no unit.
# The values are weak too: a group holds its parameters, so a strong value would keep its own key
# (and every buffer of a destroyed engine) alive forever.
# values: (runtime, unit, group) as weak references; torch's WeakIdKeyDictionary takes no type arguments
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _weak(obj: Any) -> Callable[[], Any]:
    return (lambda: None) if obj is None else weakref.ref(obj)


def _lookup(param: torch.Tensor) -> tuple[UnitGatherer | None, Unit | None, FlatParamGroup] | None:
    entry = _REGISTRY.get(param)
    if entry is None:
        return None
    runtime, unit, group = (ref() for ref in entry)
    return None if group is None else (runtime, unit, group)


def register_replicated(groups: list[FlatParamGroup], runtime: UnitGatherer | None = None) -> None:
    """Record parameters whose values every rank holds, so GatheredParameters can publish changes."""
    for group in groups:
        for param in group.params:
            _REGISTRY[param] = (_weak(runtime), _weak(None), _weak(group))


def register_unit_params(runtime: UnitGatherer, units: list[Unit]) -> None:
    """Record the sharded parameters of `units`, gathered by `runtime`."""
    for unit in units:
        for group in unit.groups:
            for param in group.params:
                _REGISTRY[param] = (_weak(runtime), _weak(unit), _weak(group))


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
    if init_shards.is_partitioned(param):  # cut by the served zero.Init, no engine yet
        return True
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
    partitioned again (master weights included); otherwise changes are discarded. Parameters
    partitioned by the served `deepspeed.zero.Init` before any engine holds them are gathered
    and cut again the same way ([Note: partitioned construction] in init_shards.py).

        with zerodist.zero.GatheredParameters(model.head.weight, modifier_rank=0):
            if rank == 0:
                model.head.weight.zero_()
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered: list[tuple[UnitGatherer, Unit]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        init_shards.gather(self.params)
        units: dict[int, tuple[UnitGatherer, Unit]] = {}
        owners = _owners(self.params)
        for runtime in {id(r): r for r, _, _, _ in owners if r is not None}.values():
            runtime.drop_early_gathers()  # its changes, or their discarding, must reach every unit ([Note: early gather])
        for runtime, unit, group, _ in owners:
            group.wait_unshard()  # stages 1/2: the last step's gather ([Note: overlapped parameter gather])
            if unit is not None and unit.state is not UnitState.UNSHARDED:
                units.setdefault(id(unit), (runtime, unit))
        self._gathered = sorted(units.values(), key=lambda ru: ru[1].index)
        for runtime, unit in self._gathered:
            runtime.unshard([unit])
            runtime.wait_unshard([unit])
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                self._publish_changes()
        for runtime, unit in self._gathered:
            runtime.reshard([unit])
        self._gathered = []
        init_shards.release(self.params, self.modifier_rank if exc[0] is None else None)

    def _publish_changes(self) -> None:
        assert self.modifier_rank is not None
        groups = {id(g): g for _, _, g, _ in _owners(self.params)}
        for group in groups.values():
            assert group.param_buffer is not None, "a gathered group has its full buffer"
            # a group of a strict-subgroup domain takes the changes of its member standing where the
            # modifier stands (each expert group publishes its own expert's)
            source = group.domain_group.peer_of(self.modifier_rank)
            comm.broadcast(group.param_buffer, src=source, group=group.group)
            group.take_shard_from_full()
