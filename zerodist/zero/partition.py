"""Building ZeRO-3: pick units, materialise a meta-built model one unit at a time, shard it.

Partitioned construction (`zerodist.zero.Init`) builds the model on the meta device, so no
rank ever holds it whole. `build_stage3()` then walks the modules in `modules()` order (the
order their constructors ran), gives each module real storage and calls its own
`reset_parameters()`, from the RNG state recorded when `Init` was entered: the same draws,
in the same order, as an eager build (see [Note: per-module init] in zerodist/models/gpt.py).
As soon as a unit's last module is materialised the unit is flattened and sharded, so the
peak is the shards plus about one unit.

Contract for models built under `Init`: all random initialisation happens in modules' own
`reset_parameters()` (the convention of torch.nn's layers, which FSDP's meta-device init
relies on too); a module with meta tensors and no `reset_parameters()` is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.stage3 import Stage3Runtime, Unit, register_replicated, select_unit_modules


@dataclasses.dataclass
class InitRecord:
    rng_state: torch.Tensor


# Keyed by module, not parameter: swap_tensors (used to materialise) refuses weakly-referenced tensors.
_INIT_RECORDS: weakref.WeakKeyDictionary[torch.nn.Module, InitRecord] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def Init() -> Iterator[InitRecord]:  # noqa: N802 - DeepSpeed's name
    """Build models inside this block on the meta device, for ZeRO-3 partitioned construction.

    Nothing is allocated; `zerodist.initialize(model=..., config={"zero_optimization":
    {"stage": 3}})` materialises and shards it unit by unit, with the values an eager build
    would have had from the RNG state at this block's start. torch's factory functions are not
    replaced: this is torch's own `torch.device("meta")` context plus a parameter-registration
    hook that remembers which parameters were made here.
    """
    record = InitRecord(torch.get_rng_state())

    def remember(module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        if param is not None:
            _INIT_RECORDS[module] = record

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(remember)
    try:
        with torch.device("meta"):
            yield record
    finally:
        handle.remove()


def _has_meta_state(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in tensors)


def _materialise(module: torch.nn.Module, name: str, device: torch.device) -> None:
    if not _has_meta_state(module):
        return
    if not callable(getattr(module, "reset_parameters", None)):
        raise RuntimeError(
            f"module '{name or '<root>'}' ({type(module).__name__}) was built on the meta device but has no "
            "reset_parameters() to initialise it; give it one, or build the model outside zerodist.zero.Init()"
        )
    # Swap storage into the existing parameter objects (torch.utils.swap_tensors): plain
    # to_empty() would replace them, and the optimizer groups and the user hold the originals.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device, recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        module.reset_parameters()


@dataclasses.dataclass
class Stage3Build:
    units: list[Unit]
    persistent: list[FlatParamGroup]
    groups_by_spec: list[list[FlatParamGroup]]
    runtime: Stage3Runtime


def _assign_units(model: torch.nn.Module, unit_modules: list[tuple[str, torch.nn.Module]]) -> dict[int, int]:
    """Parameter id -> unit index (0 = root). A parameter reachable from two units (tied
    weights) belongs to the root, which stays gathered for the whole step."""
    owner: dict[int, int] = {}
    for index, (_, module) in enumerate(unit_modules, start=1):
        for param in module.parameters():
            owner[id(param)] = index if owner.get(id(param), index) == index else 0
    inside = {id(m) for _, unit in unit_modules for m in unit.modules()}
    for module in model.modules():
        if id(module) not in inside:
            for param in module.parameters(recurse=False):
                owner[id(param)] = 0
    return owner


def build_stage3(model: torch.nn.Module, specs: list[Any], names: dict[int, str], *, config: Any, group: Any,
                 rank: int, world_size: int, param_dtype: torch.dtype, device: torch.device) -> Stage3Build:
    """Materialise (if meta-built), flatten and shard `model` for stage 3."""
    zero = config.zero_optimization
    unit_modules = select_unit_modules(model, config.zerodist.stage3_unit_classes)
    owner = _assign_units(model, unit_modules)
    spec_of = {id(p): k for k, spec in enumerate(specs) for p in spec.params}
    numels = {id(p): p.numel() for p in model.parameters()}
    persistent_ids = {pid for pid in spec_of if numels[pid] < zero.stage3_param_persistence_threshold}
    last_module = {id(list(module.modules())[-1]): index for index, (_, module) in enumerate(unit_modules, start=1)}
    groups_by_spec: list[list[FlatParamGroup]] = [[] for _ in specs]

    def flatten(params: list[torch.nn.Parameter], stage: int, bucket_numel: int) -> FlatParamGroup:
        return FlatParamGroup(params, [names[id(p)] for p in params], stage=stage, bucket_numel=bucket_numel,
                              group=group, rank=rank, world_size=world_size,
                              use_reduce_scatter=zero.reduce_scatter, param_dtype=param_dtype)

    def build_unit(index: int) -> list[FlatParamGroup]:
        built = []
        for k in range(len(specs)):
            params = [p for p in model.parameters() if owner.get(id(p)) == index and spec_of.get(id(p)) == k
                      and id(p) not in persistent_ids]
            if params:
                built.append(flatten(params, 3, max(1, sum(p.numel() for p in params))))
                groups_by_spec[k].append(built[-1])
        return built

    unit_groups: dict[int, list[FlatParamGroup]] = {}
    with _replayed_rng(model):
        for name, module in model.named_modules():
            _materialise(module, name, device)
            if id(module) in last_module:
                unit_groups[last_module[id(module)]] = build_unit(last_module[id(module)])
    unit_groups[0] = build_unit(0)
    persistent = []
    for k in range(len(specs)):
        params = [p for p in model.parameters() if id(p) in persistent_ids and spec_of[id(p)] == k]
        if params:
            bucket = max(1, min(zero.reduce_bucket_size, zero.allgather_bucket_size))
            persistent.append(flatten(params, 2, bucket))
            groups_by_spec[k].append(persistent[-1])
    units = [Unit(0, "", model, unit_groups[0])] + [
        Unit(index, name, module, unit_groups[index]) for index, (name, module) in enumerate(unit_modules, start=1)
    ]
    runtime = Stage3Runtime(model, units, units[0], persistent, group=group,
                            prefetch_numel=zero.stage3_prefetch_bucket_size,
                            max_live_numel=zero.stage3_max_live_parameters,
                            order_check=config.zerodist.debug.unit_order_check,
                            access_check=config.zerodist.debug.sharded_access_check, device=device)
    register_replicated(persistent, runtime)
    return Stage3Build(units, persistent, groups_by_spec, runtime)


@contextlib.contextmanager
def _replayed_rng(model: torch.nn.Module) -> Iterator[None]:
    """Run materialisation from the RNG state recorded by `Init` (if the model was built there),
    leaving the caller's RNG state as it was."""
    record = next((_INIT_RECORDS[m] for m in model.modules() if m in _INIT_RECORDS), None)
    saved = torch.get_rng_state()
    if record is not None:
        torch.set_rng_state(record.rng_state)
    try:
        yield
    finally:
        torch.set_rng_state(saved)
