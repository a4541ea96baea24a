"""The flattening plan: which parameters share a flat group. One plan for every ZeRO stage.

[Note: one plan for every stage] gloo's reduce-scatter is an all-reduce plus copies, and an
all-reduce adds an element's contributions from the ranks in an order that depends on the
element's position within its bucket and on the bucket's size. Two runs therefore sum the
same gradients to the same bits only if their buckets coincide: same members, same order, same
size, same padding. Stage 3 needs one group per (unit, optimizer param group, domain) so that a unit
can be gathered on its own, and a group reduces over one process group (its domain's); so every
stage flattens the same groups, with the same bucket capacity, and the sharding policy only
decides which of the resulting buffers are sharded. Stages 0-2 thus issue one collective per
unit and domain (plus one per persistent group) rather than one per model.

The plan reads the model's structure only (names, shapes, module tree), never values, so it
works on a model built on the meta device (`zerodist.zero.Init`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from zerodist.comm.topology import DENSE, Domain
from zerodist.zero.init_shards import external_ids
from zerodist.zero.units import select_unit_modules

FROZEN = -1  # `GroupPlan.spec` of a group of frozen parameters: [Note: frozen parameters at stage 3]


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One flat group: `params` in `model.parameters()` order, all of optimizer param group
    `spec` (`FROZEN`: parameters nothing trains), all of `domain`, all of unit `unit` (0 = the root
    unit), or persistent (`unit` None): parameters under the persistence threshold, which stage 3
    never shards."""

    params: tuple[torch.nn.Parameter, ...]
    spec: int
    unit: int | None
    domain: Domain = DENSE

    @property
    def persistent(self) -> bool:
        return self.unit is None

    @property
    def frozen(self) -> bool:
        return self.spec == FROZEN


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """The unit modules (unit k is `unit_modules[k - 1]`) and the groups, in build-independent
    order: each unit's groups (root first, then the units in `modules()` order; within a unit,
    by param group, then by domain in order of first appearance in `model.parameters()`), then
    the persistent groups in the same order."""

    unit_modules: tuple[tuple[str, torch.nn.Module], ...]
    groups: tuple[GroupPlan, ...]
    bucket_numel: int

    def unit_groups(self, unit: int) -> list[int]:
        """Indices into `groups` of unit `unit`'s groups."""
        return [i for i, g in enumerate(self.groups) if g.unit == unit]

    def by_spec(self, num_specs: int, built: Sequence[Any]) -> list[list[Any]]:
        """`built[i]` (one per group) regrouped by optimizer param group, in plan order."""
        return [[b for b, g in zip(built, self.groups) if g.spec == k] for k in range(num_specs)]


def bucket_capacity(reduce_bucket_size: int, allgather_bucket_size: int) -> int:
    """Elements per bucket (before padding), at every stage and for every group.

    A bucket's reduced gradient is owned in shards that the same bucket all-gathers back, so
    one capacity serves both settings: the smaller. Stage 0 runs no all-gather but uses it too,
    so that its buckets coincide with the other stages' ([Note: one plan for every stage])."""
    return max(1, min(reduce_bucket_size, allgather_bucket_size))


def assign_units(model: torch.nn.Module, unit_modules: Sequence[tuple[str, torch.nn.Module]]) -> dict[int, int]:
    """Parameter id -> unit index (0 = root). A parameter reachable from two units (tied
    weights) belongs to the root, which stays gathered for the whole step; so does one registered
    with `register_external_parameter` ([Note: external parameters] in init_shards.py)."""
    owner: dict[int, int] = {}
    for index, (_, module) in enumerate(unit_modules, start=1):
        for param in module.parameters():
            owner[id(param)] = index if owner.get(id(param), index) == index else 0
    inside = {id(m) for _, unit in unit_modules for m in unit.modules()}
    for module in model.modules():
        if id(module) not in inside:
            for param in module.parameters(recurse=False):
                owner[id(param)] = 0
    external = external_ids(model)
    for param in model.parameters():
        if id(param) in external:
            owner[id(param)] = 0
    return owner


def plan_groups(model: torch.nn.Module, spec_params: Sequence[Iterable[torch.nn.Parameter]], *,
                unit_classes: Iterable[str], persistence_threshold: int, bucket_numel: int,
                domains: Mapping[int, Domain] | None = None,
                frozen: Iterable[torch.nn.Parameter] = ()) -> FlatPlan:
    """The groups to flatten `model` into, for the trained parameters `spec_params[k]` of each
    optimizer param group k, and `domains[id(param)]` the domain of each (default: all dense).
    Parameters with fewer than `persistence_threshold` elements go to the persistent groups;
    every other one to its unit's group. `frozen` (stage 3): parameters nothing trains, sharded in
    groups of their own per unit and domain (spec `FROZEN`, after the unit's trained groups); those
    under the threshold are left out, whole on every rank ([Note: frozen parameters at stage 3])."""
    unit_modules = tuple(select_unit_modules(model, unit_classes))
    owner = assign_units(model, unit_modules)
    spec_of = {id(p): k for k, params in enumerate(spec_params) for p in params}
    spec_of.update({id(p): FROZEN for p in frozen if p.numel() >= persistence_threshold and id(p) not in spec_of})
    specs = [*range(len(spec_params)), FROZEN]
    domains = domains or {}
    domain_order: list[Domain] = []  # first appearance in model.parameters(): the same on every rank
    # (unit, spec, domain) -> params; unit -1: persistent
    members: dict[tuple[int, int, Domain], list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if id(param) in spec_of:
            unit = -1 if param.numel() < persistence_threshold else owner[id(param)]  # never for FROZEN
            domain = domains.get(id(param), DENSE)
            if domain not in domain_order:
                domain_order.append(domain)
            members.setdefault((unit, spec_of[id(param)], domain), []).append(param)
    groups = [GroupPlan(tuple(members[key]), key[1], None if key[0] == -1 else key[0], key[2])
              for unit in [*range(len(unit_modules) + 1), -1] for k in specs
              for domain in domain_order if (key := (unit, k, domain)) in members]
    return FlatPlan(unit_modules, tuple(groups), bucket_numel)
