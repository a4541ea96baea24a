"""`zerodist.initialize()`: DeepSpeed's entry point, composed from the layers below.

One short ordered recipe: config -> world -> topology -> batch sizes -> precision ->
optimizer groups -> flat groups (ZeRO) -> reducer -> sharded optimizer -> scheduler -> data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.config import Config
from zerodist.engine.dataloader import EngineDataLoader
from zerodist.engine.engine import Engine
from zerodist.engine.optimizers import check_groups_cover_model, resolve_optimizer
from zerodist.engine.schedulers import build_scheduler
from zerodist.precision import LossScaler, PrecisionPolicy
from zerodist.utils import get_logger, log_rank0
from zerodist.zero import FlatParamGroup, GradReducer, ZeroOptimizer, sharded_access
from zerodist.zero.partition import FlattenSettings, build_groups, build_stage3
from zerodist.zero.plan import bucket_capacity, plan_groups
from zerodist.zero.stage3 import Stage3Runtime, register_replicated

logger = get_logger(__name__)

# Models already wrapped, held weakly: zerodist keeps this record itself instead of marking the model.
_INITIALIZED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def initialize(
    model: torch.nn.Module,
    model_parameters: Iterable[Any] | None = None,
    optimizer: Any = None,
    config: Config | dict[str, Any] | str | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    collate_fn: Callable[..., Any] | None = None,
) -> tuple[Engine, ZeroOptimizer, EngineDataLoader | None, Any]:
    """Wrap `model` for distributed training: `engine, optimizer, dataloader, lr_scheduler`."""
    # Unchecked while building (the model is moved and cast after stage 3 registered its
    # placeholders); on leaving, the stage-3 access check is installed if any are registered.
    with sharded_access.suspended():
        return _initialize(model, model_parameters, optimizer, config, training_data, lr_scheduler, collate_fn)


def _initialize(model: torch.nn.Module, model_parameters: Iterable[Any] | None, optimizer: Any,
                config: Config | dict[str, Any] | str | None, training_data: torch.utils.data.Dataset | None,
                lr_scheduler: Any, collate_fn: Callable[..., Any] | None,
                ) -> tuple[Engine, ZeroOptimizer, EngineDataLoader | None, Any]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize(model=...) takes a torch.nn.Module, got {type(model).__name__}")
    if model in _INITIALIZED:
        raise RuntimeError(f"initialize() was already called on this {type(model).__name__}; build a new model, "
                           "or keep using the engine returned the first time")
    config = Config.load(config if config is not None else {})
    info = comm.init_distributed(timeout=config.zerodist.timeout)
    if config.zerodist.debug.collective_guard:
        from zerodist.comm.guard import enable_collective_guard

        enable_collective_guard()
    topology = comm.Topology()
    data_size = topology.size("data", "expert")
    batch = config.batch_sizes(data_size, world_size_source=f"{info.source}, WORLD_SIZE={info.world_size}")
    _check_ranks_agree(model, config)
    if info.backend == "nccl" and not any(p.is_meta for p in model.parameters()):
        model.to(comm.device_for_rank())
    policy = PrecisionPolicy.from_config(config)
    if (recast := policy.describe_recast(model)) is not None:  # before _flatten and model.to() cast it
        log_rank0(logger, recast, level=logging.WARNING)
    specs, build_optimizer = resolve_optimizer(model, model_parameters, optimizer, config)
    names = check_groups_cover_model(model, specs)
    specs = [s for s in specs if s.params]
    positions = {id(p): i for i, p in enumerate(model.parameters())}
    groups_by_spec, runtime = _flatten(model, specs, names, config, topology, policy)
    groups = [g for spec_groups in groups_by_spec for g in spec_groups]
    _sync_untrained_state(model, {id(p) for s in specs for p in s.params})
    model.to(policy.param_dtype)  # the rest of the floating state; flattened parameters already are
    zero = config.zero_optimization
    reducer = GradReducer(groups, [[positions[id(p)] for p in g.params] for g in groups],
                          max_in_flight=None if zero.stage < 2 else 2)
    if runtime is not None:
        reducer.before_sync, reducer.on_complete = runtime.before_grad_sync, runtime.on_bucket_complete
    inner = build_optimizer([{"params": [t for g in spec_groups for t in g.optimizer_tensors], **s.options}
                             for spec_groups, s in zip(groups_by_spec, specs)])
    scaler = LossScaler.from_fp16_config(config.fp16) if policy.loss_scaling else LossScaler.disabled()
    sharded = ZeroOptimizer(groups, reducer, inner, scaler=scaler, gradient_clipping=config.gradient_clipping,
                            check_overflow=policy.loss_scaling, norm_group=topology.group("data", "expert"))
    if runtime is not None and config.zerodist.debug.unit_order_check:
        sharded.step_checks.append(runtime.runs)
    scheduler = build_scheduler(config, inner, lr_scheduler)
    loader = None
    if training_data is not None:
        loader = EngineDataLoader(training_data, batch_size=batch.micro_batch_size, num_replicas=data_size,
                                  rank=topology.axis_rank("data", "expert"), collate_fn=collate_fn)
    engine = Engine(model, config=config, batch=batch, policy=policy, groups=groups, reducer=reducer,
                    optimizer=sharded, lr_scheduler=scheduler, topology=topology, stage3=runtime)
    engine.training_dataloader = loader
    _INITIALIZED.add(model)
    _log_summary(engine, info)
    if config.checkpoint.auto_resume:  # e.g. after the elastic agent restarted the job
        engine.load_checkpoint(config.checkpoint.save_dir)
    return engine, sharded, loader, scheduler


def _flatten(model: torch.nn.Module, specs: list[Any], names: dict[int, str], config: Config,
             topology: comm.Topology, policy: PrecisionPolicy) -> tuple[list[list[FlatParamGroup]], Stage3Runtime | None]:
    """The flat groups of each optimizer param group, by one plan at every stage
    ([Note: one plan for every stage]); at stage 3 also the runtime that gathers the units."""
    zero = config.zero_optimization
    group = topology.group("data", "expert")
    plan = plan_groups(model, [s.params for s in specs], unit_classes=config.zerodist.stage3_unit_classes,
                       persistence_threshold=zero.stage3_param_persistence_threshold,
                       bucket_numel=bucket_capacity(zero.reduce_bucket_size, zero.allgather_bucket_size))
    settings = FlattenSettings(stage=zero.stage, group=group, rank=topology.axis_rank("data", "expert"),
                               world_size=topology.size("data", "expert"), use_reduce_scatter=zero.reduce_scatter,
                               param_dtype=policy.param_dtype, device=comm.device_for_rank())
    groups = build_groups(model, plan, names, settings)
    runtime = None
    if zero.stage == 3:
        runtime = build_stage3(model, plan, groups, config=config, group=group, device=settings.device)
    else:
        register_replicated(groups)
    return plan.by_spec(len(specs), groups), runtime


def _fingerprint(model: torch.nn.Module, config: Config) -> tuple[str, str]:
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return digest(config.to_dict()), digest(shapes)


def _check_ranks_agree(model: torch.nn.Module, config: Config) -> None:
    """Every rank must bring the same config and model structure; otherwise fail on every rank now,
    not with a hang or silent corruption later."""
    mine = _fingerprint(model, config)
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, mine)
    for index, what in enumerate(("config", "model (parameter names, shapes, dtypes)")):
        values = [f[index] for f in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(value, []).append(rank)
            listed = "; ".join(f"ranks {r} have {v}" for v, r in groups.items())
            raise RuntimeError(f"initialize(): the ranks disagree on the {what}: {listed}. Every rank must run "
                               "the same script with the same config.")


def _sync_untrained_state(model: torch.nn.Module, trained: set[int]) -> None:
    """Frozen parameters and buffers start as rank 0's, like the trained ones."""
    for tensor in list(model.buffers()) + [p for p in model.parameters() if id(p) not in trained]:
        comm.broadcast(tensor.data, src=0)


def _log_summary(engine: Engine, info: comm.WorldInfo) -> None:
    zero = engine.config.zero_optimization
    log_rank0(
        logger,
        "initialized: %d rank(s) (%s), ZeRO stage %d, %s, batch %d = micro %d x accumulation %d x data-parallel %d, "
        "gradient_clipping %s, reduce with %s, %d flat group(s) in %d bucket(s) of at most %d elements",
        info.world_size, info.backend, zero.stage, engine.policy.name, engine.batch.train_batch_size,
        engine.batch.micro_batch_size, engine.batch.gradient_accumulation_steps, engine.topology.size("data", "expert"),
        engine.config.gradient_clipping or "0 (off)", "reduce-scatter" if zero.reduce_scatter else "all-reduce",
        len(engine.groups), len(engine.reducer.order),
        bucket_capacity(zero.reduce_bucket_size, zero.allgather_bucket_size),
    )
