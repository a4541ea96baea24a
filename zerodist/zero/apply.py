"""`apply_zero`: ZeRO's front door. One part in, its ZeRO state out.

    part -> plan (units, groups per (unit, param group, domain)) -> flat groups (materialising a
    meta-built part unit by unit) -> untrained state synced -> gradient reducer -> unit runtime ->
    sharded optimizer -> default schedule (the hooks that drive the runtime)

The config is read once, by `ZeroSettings.from_config` (settings.py): the stage is a
`ShardingPolicy` there, and nothing here branches on its number. The engine resolves the
optimizer (DeepSpeed's config, a torch optimizer or a factory) and hands in an
`OptimizerRecipe`; the scheduler and the data loader stay the engine's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

import zerodist.comm as comm
from zerodist.comm.topology import PARAMETER_AXES
from zerodist.comm.domains import buffer_placements, parameter_placements
from zerodist.comm.parts import Part
from zerodist.utils import get_logger, log_rank0
from zerodist.zero import init_shards
from zerodist.zero.canonical import CanonicalSum
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.hierarchy import domain_group
from zerodist.zero.optimizer import ZeroOptimizer
from zerodist.zero.partition import build_groups
from zerodist.zero.plan import FlatPlan, plan_groups
from zerodist.zero.reducer import GradReducer
from zerodist.zero.runtime import UnitRuntime
from zerodist.zero.schedule import DefaultSchedule
from zerodist.zero.settings import ZeroSettings
from zerodist.zero.state import ZeroState
from zerodist.zero.stepped_store import SteppedStore
from zerodist.zero.units import Unit

logger = get_logger(__name__)


class ParamGroupLike(Protocol):
    """One optimizer param group: its parameters (model order) and hyper-parameters."""

    params: list[torch.nn.Parameter]
    options: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class OptimizerRecipe:
    """The optimizer's param groups, and how to build it over the flat shards' tensors."""

    specs: Sequence[ParamGroupLike]
    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    # False for an engine built without an optimizer (it never steps): no fp32 master under bf16/fp16,
    # 4 bytes per parameter a reference model has no use for. (DeepSpeed keeps none at stage 3; at
    # stages 0-2 its bf16 optimizer over a stand-in keeps one, sharded over the data-parallel ranks.)
    steps: bool = True


def apply_zero(part: Part, topology: comm.Topology, settings: ZeroSettings, optimizer: OptimizerRecipe) -> ZeroState:
    """Flatten the part's trained parameters into one group per (unit, param group, domain), each
    reducing over its domain's group, and build the reducer, the unit runtime, the sharded
    optimizer and the default schedule that drives them."""
    # An all-fp64 model trains in fp64 when the config asks for neither bf16 nor fp16 (PrecisionPolicy.for_model).
    settings = dataclasses.replace(settings, precision=settings.precision.for_model(part.module),
                                   masters=optimizer.steps)
    model, precision, sharding = part.module, settings.precision, settings.sharding
    device = comm.device_for_rank()
    if device.type != "cpu" and init_shards.holds_any(model):  # built under the served zero.Init
        init_shards.move_unpartitioned(model, device)
    elif device.type != "cpu" and not any(p.is_meta for p in model.parameters()):
        model.to(device)
    if (recast := precision.describe_recast(model)) is not None:  # before flattening and model.to() cast it
        log_rank0(logger, recast, level=logging.WARNING)
    # An empty param group stays one (HF's Trainer makes [decay, no_decay], the second empty under LoRA):
    # the returned optimizer has the user's groups, and a scheduler's per-group lists line up with them.
    specs = list(optimizer.specs)
    positions = {id(p): i for i, p in enumerate(model.parameters())}
    frozen = frozen_to_shard(model, specs) if sharding.shard_parameters else []
    plan, built = _flatten(part, specs, frozen, topology, settings, device)
    groups = [g for g, planned in zip(built, plan.groups) if not planned.frozen]  # what trains
    frozen_groups = [g for g, planned in zip(built, plan.groups) if planned.frozen]
    _sync_untrained_state(model, {id(p) for g in built for p in g.params}, topology)
    model.to(precision.param_dtype)  # the rest of the floating state; flattened parameters already are
    reducer = GradReducer(groups, [[positions[id(p)] for p in g.params] for g in groups],
                          max_in_flight=2 if sharding.shard_gradients else None, overlap=settings.overlap)
    units = [Unit(index, name, module, [built[i] for i in plan.unit_groups(index)])
             for index, (name, module) in enumerate((("", model), *plan.unit_modules))]
    persistent = [g for g, planned in zip(built, plan.groups) if planned.persistent]
    # The run-order check compares every rank that runs the same units, whatever the domains: the
    # world, or with a pipeline one stage's ranks (every axis but pipe), whose units differ from the others'.
    same_units = topology.world_group if topology.size("pipe") == 1 else topology.group(*PARAMETER_AXES)
    runtime = UnitRuntime(units, persistent, reducer, shard_parameters=sharding.shard_parameters,
                          settings=settings.units, group=same_units, device=device)
    by_spec = plan.by_spec(len(specs), built)
    inner = optimizer.build([{"params": [t for g in spec_groups for t in g.optimizer_tensors], **s.options}
                             for spec_groups, s in zip(by_spec, specs)])
    # The step's digest check sums over the world, where a pipeline's stages legitimately differ.
    checks = ([runtime.runs] if runtime.shards_parameters and settings.units.order_check
              and topology.size("pipe") == 1 else [])
    sharded = ZeroOptimizer(groups, reducer, inner, scaler=settings.loss_scaler(),
                            gradient_clipping=settings.gradient_clipping, check_overflow=precision.loss_scaling,
                            world_group=topology.world_group, step_checks=checks)
    if settings.layout_invariant:  # every sum in a fixed order: [Note: the canonical tree] in canonical.py
        for group in groups:
            for bucket in group.buckets:
                bucket.tree = CanonicalSum(recycle=group.plan.persistent_full_grad)
        sharded.exact_norm = True
    schedule = DefaultSchedule(runtime, sharded)
    return ZeroState(model, groups, reducer, sharded, sharding, topology, precision, runtime, schedule,
                     frozen_groups=frozen_groups)


# [Note: frozen parameters at stage 3] A parameter nothing trains (a LoRA base model's weights, a
# reference or teacher model, a frozen embedding) is sharded at stage 3 like a trained one, as
# DeepSpeed partitions frozen parameters: otherwise LoRA with ZeRO-3 would keep the whole base model
# on every rank, the memory ZeRO-3 was chosen to save. Each unit's frozen parameters of one domain
# are one more flat group of that unit (`GroupPlan.frozen`), gathered and freed with the unit's
# trained groups, with no gradient buffer, bucket, fp32 master or optimizer state, and in neither
# the reducer nor the optimizer: `ZeroState.groups` are the trained groups, `ZeroState.frozen_groups`
# these. Left whole, as before: parameters under the persistence threshold (norms, biases), and
# parameters that are not plain floating `nn.Parameter`s (quantized weights such as bitsandbytes'
# 4-bit ones, whose storage and dtype are not their values).
#
# A unit's trained gradients all arriving no longer means its backward is done: the input gradient
# through a frozen weight may come after them (LoRA's adapters run backward before the base
# layer). So a unit holding frozen groups is freed in backward once its trained buckets are complete
# *and* the gradients of its forward inputs are (schedule.py's post-backward hook); a unit whose
# inputs need no gradient has nothing upstream to wait for. Checkpoints store frozen parameters
# whole, as before (gathered one group at a time to save; checkpoint/save.py).
def frozen_to_shard(model: torch.nn.Module, specs: Sequence[ParamGroupLike]) -> list[torch.nn.Parameter]:
    """The parameters of `model` that no optimizer param group trains and that stage 3 can shard:
    plain floating `nn.Parameter`s that need no gradient ([Note: frozen parameters at stage 3])."""
    trained = {id(p) for s in specs for p in s.params}
    return [p for p in model.parameters() if id(p) not in trained and not p.requires_grad
            and type(p) is torch.nn.Parameter and p.dtype.is_floating_point]


def _flatten(part: Part, specs: list[ParamGroupLike], frozen: list[torch.nn.Parameter], topology: comm.Topology,
             settings: ZeroSettings, device: torch.device) -> tuple[FlatPlan, list[Any]]:
    """The plan and its flat groups, by one plan at every stage ([Note: one plan for every stage]),
    each over its domain's group (declared placements, zerodist.comm.domains)."""
    model = part.module
    placements = parameter_placements(model)
    domains = {key: placement.domain for key, placement in placements.items()}
    plan = plan_groups(model, [s.params for s in specs], unit_classes=settings.unit_classes,
                       persistence_threshold=settings.persistence_threshold, bucket_numel=settings.bucket_numel,
                       domains=domains, frozen=frozen)
    domain_groups = {g.domain: domain_group(topology, g.domain, settings.hierarchy) for g in plan.groups}
    return plan, build_groups(model, plan, part.names, settings, domain_groups=domain_groups, placements=placements,
                              device=device)


def _sync_untrained_state(model: torch.nn.Module, trained: set[int], topology: comm.Topology) -> None:
    """Frozen parameters and buffers start as the first rank's of their domain group, like the
    trained ones (an expert's buffers are its own: they agree within its expert-data group only)."""
    placements = {**parameter_placements(model), **buffer_placements(model)}
    tensors = list(model.buffers()) + [p for p in model.parameters() if id(p) not in trained]
    for tensor in tensors:
        axes = placements[id(tensor)].domain.replicated_axes
        group = topology.group(*axes)
        comm.broadcast(tensor.data, src=topology.ranks(*axes)[0], group=group)


def offload_stepped_values(groups: list[FlatParamGroup], store: SteppedStore, *, shard: bool) -> int:
    """Hand the stepped values to `store`: every group's fp32 master, and with `shard` also the
    parameter shards of sharded groups (their fp32 values are the stepped tensors, or a cast of the
    master). Returns the number of groups whose values left memory."""
    chosen = [g for g in groups if g.master is not None or (shard and g.param_shard is not None)]
    held: dict[torch.Tensor, Callable[[int, torch.Tensor], None] | None] = {}
    for group in chosen:
        for index, tensor in enumerate(group.optimizer_tensors):
            held[tensor] = _caster(group, index) if group.master is not None else None
    if not held:
        return 0
    store.hold_values(held)
    for group in chosen:
        group.release_stepped(store, shard)
    return len(chosen)


def _caster(group: FlatParamGroup, index: int) -> Callable[[int, torch.Tensor], None]:
    def cast(start: int, values: torch.Tensor) -> None:
        group.cast_stepped(index, start, values)
    return cast
