"""Building the flat groups of a plan: materialise a meta-built model one unit at a time, flatten it.

Partitioned construction (`zerodist.zero.Init`) builds the model on the meta device, so no
rank ever holds it whole, and records every operation on its tensors. `build_groups()` then
walks the modules in `modules()` order, and gives each module real storage holding the values
an eager build would have had, by replaying its tensors' recorded history (see
[Note: recorded init] in zerodist/zero/replay_init.py). As soon as a unit's last module is
materialised the unit is flattened (and at stage 3 sharded), so at stage 3 the peak is the
shards plus about one unit. `apply_zero()` (apply.py) then makes the units and their runtime.

A model built under the served `deepspeed.zero.Init` holds each parameter's shard in a side table
(init_shards.py): each module's shards are gathered as the walk reaches it, then flattened the same way.

A model put on the meta device by other means (`torch.device("meta")`) has no record: each of
its modules with meta tensors is given storage and its own `reset_parameters()` is called, from
the current RNG state; a module without one is an error.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zerodist import compat
from zerodist.comm import Group
from zerodist.comm.domains import Placement
from zerodist.comm.topology import Domain
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero import init_shards
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.init_keywords import check_init_keywords
from zerodist.zero.plan import FlatPlan
from zerodist.zero.policy import DomainGroup
from zerodist.zero.replay_init import InitLog, Recording, Replayer
from zerodist.zero.settings import ZeroSettings


# Keyed by module, not parameter: swap_tensors (used to materialise) refuses weakly-referenced tensors.
_INIT_LOGS: weakref.WeakKeyDictionary[torch.nn.Module, InitLog] = weakref.WeakKeyDictionary()


def Init(module: torch.nn.Module | None = None, data_parallel_group: Group = None,  # noqa: N802 - DeepSpeed's name
         mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
         config_dict_or_path: Any = None, config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None,
         mpu: Any = None, **deepspeed_keywords: Any) -> contextlib.AbstractContextManager[InitLog | None]:
    """Build models inside this block on the meta device, for ZeRO-3 partitioned construction.

    Nothing is allocated; `zerodist.initialize(model=..., config={"zero_optimization":
    {"stage": 3}})` materialises and shards it unit by unit, with the values an eager build
    would have had: every operation on the model's tensors is recorded here and replayed
    later, random ones from the RNG state they drew from (see [Note: recorded init] in
    zerodist/zero/replay_init.py). With tensor parallelism the layers are sliced on the meta
    device first, and each rank materialises the eager build's slices ([Note: recording
    continued]). torch's factory functions are not replaced: this is torch's
    own `torch.device("meta")` context, a dispatch mode that records, and registration hooks.

    DeepSpeed's keywords: `enabled=False` builds eagerly; `config_dict_or_path` is validated now;
    `dtype` must be the one that config trains in; `mem_efficient_linear` changes nothing (torch's
    linear is never replaced); keywords asking for offload, other groups or quantization are
    refused with the reason (zero/init_keywords.py).
    """
    check_init_keywords(module=module, data_parallel_group=data_parallel_group, remote_device=remote_device,
                        pin_memory=pin_memory, config_dict_or_path=config_dict_or_path, config=config, dtype=dtype,
                        mpu=mpu, extra=deepspeed_keywords)
    del mem_efficient_linear
    return _meta_construction() if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _meta_construction() -> Iterator[InitLog]:
    with Recording() as recording:
        try:
            yield recording.log
        finally:
            for module in recording.modules:
                _INIT_LOGS[module] = recording.log


# [Note: recording continued] A step of initialize() that rebuilds part of a meta-built model
# before ZeRO materialises it (tensor parallelism: a layer replaced by one holding this rank's
# slice) runs inside `continue_recording(model)`: the slicing (narrow, cat, padding) on the meta
# weights is recorded into the same log, after the operations that initialised them, and the new
# modules join the log. Replaying a slice then replays its source tensor's whole history (the full
# weight, drawn from its recorded RNG state), and slices it: the bits of the eager build's slice,
# with one source tensor at a time alive, for the duration of one module's materialisation.
@contextlib.contextmanager
def continue_recording(model: torch.nn.Module) -> Iterator[bool]:
    """Record what the block does to `model`'s meta tensors into the log of the `Init` block that
    built it (see [Note: recording continued]); yields whether there is such a log. A model built
    eagerly (or without meta tensors) passes through unrecorded."""
    recorded = {module: log for module in model.modules() if (log := _INIT_LOGS.get(module)) is not None}
    logs = list({id(log): log for log in recorded.values()}.values())
    if not logs:
        yield False
        return
    log = logs[0] if len(logs) == 1 else InitLog.merged(logs)  # built in several Init blocks
    for module in recorded:
        _INIT_LOGS[module] = log
    with Recording(log) as recording:
        try:
            yield True
        finally:
            for module in recording.modules:
                _INIT_LOGS[module] = log


def is_recorded(module: torch.nn.Module) -> bool:
    """Whether `module`'s meta tensors were made under `zerodist.zero.Init()` (and can be replayed)."""
    return module in _INIT_LOGS


def _has_meta_state(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in tensors)


def _materialise(module: torch.nn.Module, name: str, device: torch.device) -> None:
    init_shards.restore(module, device)  # cut by the served zero.Init ([Note: partitioned construction])
    if not _has_meta_state(module):
        return
    log = _INIT_LOGS.get(module)
    if log is not None:
        _materialise_recorded(module, name, log, device)
        return
    if not callable(getattr(module, "reset_parameters", None)):
        raise RuntimeError(
            f"module '{name or '<root>'}' ({type(module).__name__}) was built on the meta device but has no "
            "reset_parameters() to initialise it; give it one, or build the model inside zerodist.zero.Init() "
            "(which records and replays its initialisation), or outside the meta device"
        )
    # Swap storage into the existing parameter objects (torch.utils.swap_tensors): plain
    # to_empty() would replace them, and the optimizer groups and the user hold the originals.
    with compat.swap_module_params_on_conversion():
        module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        module.reset_parameters()  # type: ignore[operator]  # checked callable above


def _materialise_recorded(module: torch.nn.Module, name: str, log: InitLog, device: torch.device) -> None:
    """Replay the recorded history of this module's own meta tensors and swap the values into
    the same parameter and buffer objects (the optimizer groups and the user hold them)."""
    replayer = Replayer()
    tensors: list[tuple[str, torch.Tensor, bool]] = [
        (f"parameter '{n}'", t, True) for n, t in module.named_parameters(recurse=False)]
    tensors += [(f"buffer '{n}'", t, False) for n, t in module.named_buffers(recurse=False)]
    for what, tensor, is_parameter in tensors:
        if not tensor.is_meta:
            continue  # already materialised through a module that shares it (tied weights)
        described = f"{what} of module '{name or '<root>'}' ({type(module).__name__})"
        value = replayer.final_value(log, tensor, described).to(device)
        if is_parameter:
            value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, value)
    del _INIT_LOGS[module]  # the log (RNG states, copied inputs) goes when its last module is materialised


def build_groups(model: torch.nn.Module, plan: FlatPlan, names: dict[int, str], settings: ZeroSettings, *,
                 domain_groups: Mapping[Domain, DomainGroup], placements: Mapping[int, Placement],
                 device: torch.device) -> list[FlatParamGroup]:
    """Materialise `model` (if meta-built) and flatten it by `plan`: one group per planned group,
    in plan order, at every stage ([Note: one plan for every stage]). Each group reduces and
    shards over its domain's group (`domain_groups`: every domain of the plan; `placements`:
    id(param) -> its declared placement, zerodist.comm.domains); with sharded parameters the
    unit groups are sharded and the persistent ones keep full parameters
    (`ShardingPolicy.for_persistent`).

    A unit's groups are built as soon as its last module is materialised, so at stage 3 the
    peak is the shards plus about one unit; the root's and the persistent groups come last."""
    built: dict[int, FlatParamGroup] = {}
    # Stage 3: one pool of gathered and staging buffers for every group ([Note: buffer pool]).
    policy = settings.sharding
    pool = BufferPool() if policy.shard_parameters else None

    def flatten(indices: list[int]) -> None:
        for i in indices:
            planned = plan.groups[i]
            built[i] = FlatParamGroup(list(planned.params), [names[id(p)] for p in planned.params],
                                      policy=policy.for_persistent() if planned.persistent else policy,
                                      domain_group=domain_groups[planned.domain], bucket_numel=plan.bucket_numel,
                                      use_reduce_scatter=settings.use_reduce_scatter,
                                      param_dtype=settings.precision.param_dtype,
                                      placements=[placements[id(p)] for p in planned.params], buffer_pool=pool,
                                      keep_master=settings.masters, trainable=not planned.frozen)

    last_module = {id(list(module.modules())[-1]): unit
                   for unit, (_, module) in enumerate(plan.unit_modules, start=1)}
    with _replayed_rng(model):
        for name, module in model.named_modules():
            _materialise(module, name, device)
            if id(module) in last_module:
                flatten(plan.unit_groups(last_module[id(module)]))
    flatten(plan.unit_groups(0))
    flatten([i for i, g in enumerate(plan.groups) if g.persistent])
    return [built[i] for i in range(len(plan.groups))]


@contextlib.contextmanager
def _replayed_rng(model: torch.nn.Module) -> Iterator[None]:
    """Materialise without disturbing the caller's RNG: replay sets the recorded state before each
    random operation, and `reset_parameters()` draws from the current one."""
    saved = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved)
