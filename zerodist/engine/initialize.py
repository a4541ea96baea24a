"""`zerodist.initialize()`: DeepSpeed's entry point, composed from the layers below.

One short ordered recipe, each step a function with a typed input and output:

    validate -> topology -> split into parts (`zerodist.pipe.apply_pipeline` for a PipelineModule:
                            its stages on this rank; else the whole model: zerodist/comm/parts.py)
             -> per part: apply tensor parallel -> sequence parallel -> expert parallel
                          -> apply ZeRO (`zerodist.zero.apply_zero`: flat groups per domain,
                             reducer, unit runtime, sharded optimizer, default schedule)
             -> scheduler -> engine (its part states by name, its batch runner) (+ data loader)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.domains import expert_parallel_degree
from zerodist.comm.parts import Part, PartRoles, PartStates, split_parts
from zerodist.config import BatchSizes, Config
from zerodist.data.sampler import LayoutInvariantSampler
from zerodist.engine.dataloader import EngineDataLoader
from zerodist.engine.deepspeed_args import DEFAULT_PORT, resolve_initialize_arguments, update_args_local_rank
from zerodist.engine.engine import Engine
from zerodist.engine.optimizers import check_groups_cover_model, resolve_optimizer, steps_nothing
from zerodist.engine.pipeline import PipelineRunner
from zerodist.engine.schedulers import build_scheduler
from zerodist.moe.layer import routing_lines
from zerodist.moe.parallel import LayoutInvariantDealing, apply_expert_parallel_part, restore_routing_clock
from zerodist.offload import OffloadSettings, SwappedOptimizer, close_offload, offloaded_build
from zerodist.pipe.apply import PipelineSettings, PipelineState, apply_pipeline, pipe_degree_of, pipeline_fingerprint
from zerodist.pipe.module import PipelineModule
from zerodist.pipe.split import SplitPipelineModule
from zerodist.sequence.apply import SequenceSettings, apply_sequence_parallel
from zerodist.sequence.data import SequenceShardLoader
from zerodist.tensor_parallel.apply import (TENSOR_PARALLEL_LAYERS, TensorParallelSettings, TensorParallelState,
                                            apply_tensor_parallel)
from zerodist.tensor_parallel.plan import PlanError
from zerodist.tensor_parallel.random import rng_tracker_of
from zerodist.tensor_parallel.domino import DominoConfig
from zerodist.utils import get_logger, log_rank0
from zerodist.utils.differences import differing_entries, flatten
from zerodist.utils.helpers import model_hidden_size
from zerodist.zero import OptimizerRecipe, ZeroOptimizer, ZeroSettings, ZeroState, apply_zero, init_shards, sharded_access
from zerodist.zero.partition import continue_recording, is_recorded
from zerodist.zero.plan import bucket_capacity
from zerodist.zero.policy import ShardingPolicy
from zerodist.zero.apply import offload_stepped_values
from zerodist.zero.canonical import check_layout, micro_batch_index, tree_sum

logger = get_logger(__name__)

# Models already wrapped, held weakly: zerodist keeps this record itself instead of marking the model.
_INITIALIZED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _expert_dealing(validated: Validated, topology: comm.Topology, accumulation: int,
                    pipeline: bool) -> LayoutInvariantDealing | None:
    """The layout-invariant mode's micro-batch order for the MoE layers (routing keys, expert gradients).
    `pipeline`: a PipelineModule is trained (its stages on one rank or several), the sampler's rule."""
    if not validated.zero.layout_invariant:
        return None
    # a pipeline reduces once per step and deals contiguously at every stage (engine/pipeline_invariant.py),
    # also at pipe degree 1 (all its stages on one rank): the test is the pipeline, not the degree
    shard = validated.zero.sharding.shard_gradients and not pipeline
    degree = topology.num_batch_shards
    return LayoutInvariantDealing(lambda rank, micro: micro_batch_index(rank, micro, degree, accumulation, shard),
                                  interleaved=shard, tree_sum=tree_sum)


def _reduction_keys(config: Config, mics_shards: bool) -> tuple[str, ...]:
    """The keys set that choose their own gradient summation or gathered values (layout-invariant
    refuses them). `mics_shards`: MiCS shards below the data degree on this topology (a shard size of
    1 still reduces across its replicas in the backend's order; one of the data degree is plain ZeRO)."""
    zero = config.zero_optimization
    keys = [("communication_data_type", config.communication_data_type is not None),
            ("zero_optimization.mics_shard_size", mics_shards),
            ("zero_optimization.zero_quantized_gradients", zero.zero_quantized_gradients),
            ("zero_optimization.zero_quantized_weights", zero.zero_quantized_weights)]
    return tuple(name for name, on in keys if on)


@dataclasses.dataclass(frozen=True)
class Validated:
    """The output of `_validate`: a config every rank agrees on, in an initialised world."""

    config: Config
    world: comm.WorldInfo
    zero: ZeroSettings  # ZeRO's settings, read from the config once (the policy derived there)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Config | dict[str, Any] | str | None = None,
    mesh_param: Any = None,
    config_params: Config | dict[str, Any] | str | None = None,
) -> tuple[Engine, ZeroOptimizer, EngineDataLoader | None, Any]:
    """Wrap `model` for distributed training: `engine, optimizer, dataloader, lr_scheduler`.
    DeepSpeed's signature and meanings (the config from `args.deepspeed_config` when `config` is
    None); see zerodist/engine/deepspeed_args.py and docs/deepspeed.md."""
    config = resolve_initialize_arguments(args=args, model=model, config=config, config_params=config_params, mpu=mpu,
                                          mesh_param=mesh_param, distributed_port=distributed_port,
                                          dist_init_required=dist_init_required)
    # Unchecked while building (the model is moved and cast after stage 3 registered its
    # placeholders); on leaving, the stage-3 access check is installed if any are registered.
    with sharded_access.suspended():
        result = _initialize(model, model_parameters, optimizer, config, training_data, lr_scheduler, collate_fn)
    update_args_local_rank(args, result[0].local_rank)
    return result


def _initialize(model: torch.nn.Module | None, model_parameters: Iterable[Any] | None, optimizer: Any,
                config: Config | dict[str, Any] | str | None, training_data: torch.utils.data.Dataset | None,
                lr_scheduler: Any, collate_fn: Callable[..., Any] | None,
                ) -> tuple[Engine, ZeroOptimizer, EngineDataLoader | None, Any]:
    """The ordered steps; each takes what the previous ones made."""
    validated = _validate(model, config)
    assert isinstance(model, torch.nn.Module)  # _validate refused anything else, by name
    topology = _build_topology(validated, model)
    world = validated.world
    batch = validated.config.batch_sizes(topology.num_batch_shards,
                                         world_size_source=f"{world.source}, WORLD_SIZE={world.world_size}")
    if validated.zero.layout_invariant:  # refused alike on every rank, before any technique's collective
        check_layout(data_degree=topology.size("data"), accumulation=batch.gradient_accumulation_steps,
                     stage=validated.config.zero_optimization.stage, pipe=topology.size("pipe"),
                     pipeline=isinstance(model, PipelineModule),
                     sequence=topology.size("sequence"), expert=topology.size("expert"),
                     fp16=validated.zero.precision.loss_scaling,
                     tensor_sequence_parallel=validated.config.zerodist.tensor_parallel.sequence_parallel,
                     schedule=validated.config.zerodist.pipeline.schedule,
                     reduction_keys=_reduction_keys(
                         validated.config, validated.zero.hierarchy.shard_size_for(topology) is not None))
    # Cut by the served zero.Init: the model whole again before a technique reads or slices its values
    # (they are placeholders until then); every rank holds the same modules here
    if any(topology.size(axis) > 1 for axis in ("tensor", "pipe", "expert")) and init_shards.holds_any(model):
        init_shards.restore_all(model)
    # A PipelineModule: its tie groups made and synced (before ZeRO flattens), its schedule and executor
    pipeline = apply_pipeline(model, topology, PipelineSettings.from_config(validated.config),
                              batch.gradient_accumulation_steps)
    parts = PartStates()
    try:
        (part,) = pipeline.parts if pipeline is not None else split_parts(model)
        if pipeline is not None:
            parts.add("pipe", pipeline)
        part = _apply_techniques(part, parts, model_parameters, optimizer, topology, validated, batch,
                                 pipeline)
        zero: ZeroState = parts["zero"]
        scheduler = build_scheduler(validated.config, zero.optimizer.inner, lr_scheduler)
        engine, loader = _build_engine(part.module, parts, batch, scheduler, validated, training_data, collate_fn)
    except BaseException:
        parts.remove_hooks()  # e.g. the tie hooks off the user's parameters
        raise
    return engine, zero.optimizer, loader, scheduler


def _apply_techniques(part: Part, parts: PartStates, model_parameters: Iterable[Any] | None, optimizer: Any,
                      topology: comm.Topology, validated: Validated, batch: BatchSizes,
                      pipeline: PipelineState | None) -> Part:
    """Per part: tensor -> sequence -> expert -> ZeRO, each state added to `parts` by name with the
    roles the engine calls it for (zerodist/comm/parts.py `PartRoles`)."""
    config = validated.config
    tensor = _apply_tensor_parallel(part, topology, validated)
    part = dataclasses.replace(part, module=tensor.module)
    module = part.module
    parts.add("tensor", tensor, PartRoles(
        rng_key="tensor_parallel", rng_state=lambda: _tracker(module).state_dict(),
        load_rng_state=lambda state: _tracker(module).load_state_dict(state)) if rng_tracker_of(module) else None)
    if pipeline is not None:
        pipeline.check_tied_layers_kept()
    sequence = apply_sequence_parallel(part, topology, SequenceSettings.from_config(config),
                                       stages=module if isinstance(module, SplitPipelineModule) else None)
    parts.add("sequence", sequence, PartRoles(
        # each sequence rank keeps its slice of every sample (a pipeline's runner slices its micro-batches)
        wrap_loader=lambda loader: SequenceShardLoader(loader, sequence.layout))
        if sequence.shards_batches and pipeline is None else None)
    # MoE layers get their expert group and routing keys; random routing is keyed by micro-batch
    experts = apply_expert_parallel_part(module, topology, batch.gradient_accumulation_steps,
                                         _expert_dealing(validated, topology, batch.gradient_accumulation_steps,
                                                         pipeline=pipeline is not None))
    parts.add("expert", experts, PartRoles(resume=lambda micro_steps: restore_routing_clock(module, micro_steps),
                                           step_lines=lambda: routing_lines(module)))
    zero = _apply_zero(part, model_parameters, optimizer, topology, validated)
    parts.add("zero", zero, PartRoles(close=lambda: close_offload(zero.inner_optimizer)))
    return part


def _tracker(module: torch.nn.Module) -> Any:
    tracker = rng_tracker_of(module)
    assert tracker is not None, "tensor parallelism's random streams went missing"
    return tracker


def _validate(model: torch.nn.Module | None, config: Config | dict[str, Any] | str | None) -> Validated:
    """The model is a fresh module, the config valid, the world initialised, and every rank
    brings the same config and model structure."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize(model=...) takes a torch.nn.Module, got {type(model).__name__}")
    if model in _INITIALIZED:
        raise RuntimeError(f"initialize() was already called on this {type(model).__name__}; build a new model, "
                           "or keep using the engine returned the first time")
    # "auto" bucket sizes come from the model's hidden size, as the Trainer would fill them
    config = Config.load(config if config is not None else {}, hidden_size=model_hidden_size(model))
    world = comm.init_distributed(timeout=config.zerodist.timeout)
    comm.simulate_nodes(config.zerodist.simulated_nodes)  # None: the launcher's nodes (zerodist/comm/nodes.py)
    if config.zerodist.hang_warning is not None:
        comm.set_hang_warning(config.zerodist.hang_warning)
    if config.zerodist.debug.collective_guard:
        from zerodist.comm.guard import enable_collective_guard

        enable_collective_guard()
    _check_ranks_agree(model, config)
    return Validated(config, world, ZeroSettings.from_config(config))


def _build_topology(validated: Validated, model: torch.nn.Module) -> comm.Topology:
    """The mesh: the expert degree the model declares (`zerodist.comm.domains.
    declare_expert_parallel`, 1 when none), the tensor degree from the config
    (`tensor_parallel.autotp_size` or `zerodist.tensor_parallel.size`), data the rest."""
    # Stage 3 reduces gradients on groups of their own, beside the gathers its hooks issue
    # ([Note: gradient groups] in zerodist/comm/topology.py).
    return comm.Topology(expert=expert_parallel_degree(model), tensor=validated.config.tensor_degree,
                         sequence=validated.config.sequence_parallel_size, pipe=pipe_degree_of(model),
                         gradient_groups=validated.zero.sharding.shard_parameters)


def _apply_tensor_parallel(part: Part, topology: comm.Topology, validated: Validated) -> TensorParallelState:
    """Converts the model's layers to tensor-parallel ones by its plan and declares their slices'
    placements (zerodist.comm.domains); Domino when configured."""
    config = validated.config
    section = config.zerodist.tensor_parallel
    partition = config.tensor_parallel.partition_config
    settings = TensorParallelSettings(
        degree=config.tensor_degree, partition_config=partition.model_dump() if partition is not None else None,
        sequence_parallel=section.sequence_parallel,
        sharded_parameters=validated.zero.sharding.shard_parameters,
        domino=DominoConfig(section.domino.chunks, section.domino.overlap) if section.domino is not None else None)
    # A model built under zerodist.zero.Init() is still on the meta device: its layers are sliced
    # there, in its record, and ZeRO materialises each slice from its own replayed full weight
    # ([Note: recording continued] in zerodist/zero/partition.py).
    # A stage cut from the user's model by split_model keeps its names: the model's own plan applies
    source = part.module.source_model() if isinstance(part.module, SplitPipelineModule) else None
    state = apply_tensor_parallel(part.module, topology, settings, conversion=continue_recording(part.module),
                                  plan_for=source)
    _check_sliced_layers_materialisable(state.module)
    return state


def _check_sliced_layers_materialisable(model: torch.nn.Module) -> None:
    """A tensor-parallel layer left on the meta device outside any `Init` record (a model put on
    the meta device by other means, or parallelized by the user there) has no full weight to slice
    from: refuse it now, by name, rather than fail or draw slices that match no one-process model."""
    unrecorded = [name for name, module in model.named_modules() if isinstance(module, TENSOR_PARALLEL_LAYERS)
                  and any(p.is_meta for p in module.parameters(recurse=False)) and not is_recorded(module)]
    if unrecorded:
        raise PlanError(
            f"the tensor-parallel layers {unrecorded[:4]}{' ...' if len(unrecorded) > 4 else ''} are on the meta "
            "device without a record of their initialisation, so their slices cannot be made equal to the "
            "one-process model's: build the unparallelized model under zerodist.zero.Init() (or eagerly) and let "
            "initialize() apply the plan, or call parallelize() inside the same Init() block that built the model")


def _apply_zero(part: Part, model_parameters: Iterable[Any] | None, optimizer: Any, topology: comm.Topology,
                validated: Validated) -> ZeroState:
    """The optimizer's param groups (DeepSpeed's config, a torch optimizer or a factory), checked to
    cover the part; then ZeRO's front door."""
    config = validated.config
    specs, build_optimizer = resolve_optimizer(part.module, model_parameters, optimizer, config)
    check_groups_cover_model(part.module, specs)
    # Offload wraps the optimizer zero steps its shards with (zerodist/offload): zero never knows.
    offload = OffloadSettings.from_config(config)
    # Its failures are agreed over one pipeline stage's ranks: other stages gather other units, so a
    # stage's shard reads (zero/runtime.py) are not matched by theirs.
    build_optimizer = offloaded_build(build_optimizer, offload, topology.group(*topology.stage_axes),
                                      comm.device_for_rank())
    # apply_zero makes an all-fp64 model train in fp64 (no bf16/fp16 section): PrecisionPolicy.for_model
    zero = apply_zero(part, topology, validated.zero,
                      OptimizerRecipe(specs, build_optimizer, steps=not steps_nothing(optimizer, config)))
    if isinstance(zero.optimizer.inner, SwappedOptimizer):
        # The fp32 master (bf16/fp16) and, with offload_param nvme, the stage-3 parameter shards move into
        # the swap files too ([Note: stepped values elsewhere] in zerodist/zero/stepped_store.py).
        offload_stepped_values(zero.groups, zero.optimizer.inner, shard=offload.param_device == "nvme")
    return zero


def _build_engine(model: torch.nn.Module, parts: PartStates, batch: BatchSizes, scheduler: Any, validated: Validated,
                  training_data: torch.utils.data.Dataset | None,
                  collate_fn: Callable[..., Any] | None) -> tuple[Engine, EngineDataLoader | None]:
    config, world, zero = validated.config, validated.world, parts["zero"]
    topology = zero.topology
    loader: Any = None  # an EngineDataLoader, wrapped by the techniques that read batches their own way
    if training_data is not None:  # dealt by batch shard: tensor- and sequence-parallel peers read the same samples
        sampler = (LayoutInvariantSampler(len(training_data), micro_batch_size=batch.micro_batch_size,  # type: ignore[arg-type]
                                          accumulation=batch.gradient_accumulation_steps,
                                          num_replicas=topology.num_batch_shards, rank=topology.batch_rank,
                                          # a pipeline reduces once per step: contiguous at every stage
                                          shard_gradients=zero.sharding.shard_gradients and "pipe" not in parts)
                   if validated.zero.layout_invariant else None)
        loader = parts.wrap_loader(EngineDataLoader(training_data, batch_size=batch.micro_batch_size,
                                                    num_replicas=topology.num_batch_shards, rank=topology.batch_rank,
                                                    collate_fn=collate_fn, sampler=sampler))
    pipeline = parts.get("pipe")
    engine = Engine(model, config=config, batch=batch, part_states=parts, lr_scheduler=scheduler,
                    training_dataloader=loader, runner=PipelineRunner(pipeline) if pipeline is not None else None)
    _INITIALIZED.add(model)
    _log_summary(engine, world)
    if config.checkpoint.auto_resume:  # e.g. after the elastic agent restarted the job
        assert config.checkpoint.save_dir is not None, "the config requires checkpoint.save_dir with auto_resume"
        engine.load_checkpoint(config.checkpoint.save_dir)
    return engine, loader


def _fingerprint(model: torch.nn.Module, config: Config) -> tuple[str, str]:
    # A PipelineModule's ranks hold different layers: they agree on the whole pipeline's plan instead.
    shapes = pipeline_fingerprint(model) or _tensor_facts(model)
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return digest(config.to_dict()), digest(shapes)


def _tensor_facts(model: torch.nn.Module) -> dict[str, str]:
    """Name -> "shape dtype" of every parameter and buffer (buffers are broadcast from the first rank
    of their group at initialize: of another shape on one rank, that broadcast would abort the rank)."""
    return {**{n: f"{tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters()},
            **{f"{n} (buffer)": f"{tuple(b.shape)} {b.dtype}" for n, b in model.named_buffers()}}


def _check_ranks_agree(model: torch.nn.Module, config: Config) -> None:
    """Every rank must bring the same config and model structure; otherwise fail on every rank now,
    not with a hang or silent corruption later."""
    mine = _fingerprint(model, config)
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, mine)
    if len(set(everyone)) == 1:
        return
    # Rare path, every rank alike: the whole config and parameter list, to name what differs.
    details: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(details, (flatten(config.to_dict()), _tensor_facts(model)))
    for index, what in enumerate(("config key(s)", "model's parameter(s) and buffer(s) (name: shape dtype)")):
        lines = differing_entries([d[index] for d in details])
        if lines:
            raise RuntimeError(f"initialize(): the ranks disagree on the {what}:\n  " + "\n  ".join(lines) +
                               "\nEvery rank must run the same script with the same config.")
    raise RuntimeError(f"initialize(): the ranks disagree on the config or model (digests {everyone}); every rank "
                       "must run the same script with the same config.")


def reduce_collective(sharding: ShardingPolicy, reduce_scatter: bool) -> str:
    """The collective that really reduces gradient buckets: with full optimizer state (stage 0)
    always all-reduce, as DDP; otherwise the configured one."""
    if not sharding.shard_optimizer_state:
        return "all-reduce" + (" (reduce_scatter applies from stage 1)" if reduce_scatter else "")
    return "reduce-scatter" if reduce_scatter else "all-reduce"


def _log_summary(engine: Engine, info: comm.WorldInfo) -> None:
    zero = engine.config.zero_optimization
    domains = {g.domain.reduce_axes: g.world_size for g in engine.groups}
    log_rank0(
        logger,
        "initialized: %d rank(s) (%s), ZeRO stage %d, %s, batch %d = micro %d x accumulation %d x data-parallel %d, "
        "gradient_clipping %s, reduce with %s %s, %d flat group(s) in %d bucket(s) of at most %d elements over %s%s",
        info.world_size, info.backend, zero.stage, engine.policy.name, engine.batch.train_batch_size,
        engine.batch.micro_batch_size, engine.batch.gradient_accumulation_steps, engine.topology.num_batch_shards,
        engine.config.gradient_clipping or "0 (off)", reduce_collective(engine.sharding, zero.reduce_scatter),
        "during backward" if zero.overlap_comm else "after backward (overlap_comm false)",
        len(engine.groups), len(engine.reducer.order),
        bucket_capacity(zero.reduce_bucket_size, zero.allgather_bucket_size),
        ", ".join(f"{'x'.join(axes)} ({size} ranks)" for axes, size in domains.items()),
        "" if not engine.units.gather_groups else (
            ", updated parameters all-gathered " + ("during the next forward" if zero.overlap_comm
                                                    else "at the end of step() (overlap_comm false)")),
    )
    for line in engine.part_states.report():  # what each technique did to this rank's part
        log_rank0(logger, "  %s", line)
