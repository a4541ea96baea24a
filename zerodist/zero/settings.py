"""`ZeroSettings`: what ZeRO takes from the config, read once (principle 7).

`ZeroSettings.from_config(config)` is the zero package's one reader of the config: every choice
ZeRO makes from it is resolved here, once, and travels as this frozen object (apply.py hands it
to the plan, the flat groups and the unit runtime; nothing below reads the config again):

    sharding            the ZeRO stage as a `ShardingPolicy`: the one place the stage becomes a policy.
                        The engine takes it from here for the other layers that must know it (the
                        topology's gradient groups, tensor parallelism's sharded-parameter mode)
                        rather than deriving it again.
    use_reduce_scatter  the collective gradient buckets reduce with, resolved against the policy:
                        `zero_optimization.reduce_scatter` is a ZeRO 1-3 setting (as in DeepSpeed).
                        With full optimizer state (stage 0) every rank steps the whole bucket, so a
                        reduce-scatter would need an all-gather after it (and gloo implements
                        reduce-scatter as an all-reduce plus copies, 1.5x the bytes): stage 0
                        all-reduces, as DDP does, whatever the config says.
    units               the unit runtime's settings (`UnitSettings`, runtime.py)
    hierarchy           past one machine (`HierarchySettings`, hierarchy.py): MiCS / HSDP shard groups,
                        the gradient reduction's data type (`communication_data_type`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zerodist.config import Config
from zerodist.precision import LossScaler, PrecisionPolicy
from zerodist.zero.hierarchy import HierarchySettings
from zerodist.zero.plan import bucket_capacity
from zerodist.zero.policy import ShardingPolicy
from zerodist.zero.runtime import UnitSettings


@dataclasses.dataclass(frozen=True)
class ZeroSettings:
    """What ZeRO takes from the config (`from_config`): the config sliced for this layer, resolved once."""

    sharding: ShardingPolicy
    precision: PrecisionPolicy
    unit_classes: tuple[str, ...]  # zerodist.stage3_unit_classes
    persistence_threshold: int  # zero_optimization.stage3_param_persistence_threshold
    bucket_numel: int  # reduce_bucket_size / allgather_bucket_size
    use_reduce_scatter: bool  # zero_optimization.reduce_scatter, where the optimizer state is sharded (stages 1-3)
    overlap: bool  # zero_optimization.overlap_comm
    units: UnitSettings
    gradient_clipping: float
    loss_scaler: Callable[[], LossScaler]
    hierarchy: HierarchySettings = HierarchySettings()
    layout_invariant: bool = False  # zerodist.deterministic: "layout_invariant" (canonical.py)
    masters: bool = True  # fp32 masters under bf16/fp16; False where nothing steps (OptimizerRecipe.steps)

    @classmethod
    def from_config(cls, config: Config) -> ZeroSettings:
        zero, debug = config.zero_optimization, config.zerodist.debug
        sharding = ShardingPolicy.from_stage(zero.stage)
        precision = PrecisionPolicy.from_config(config)
        scaler = ((lambda: LossScaler.from_fp16_config(config.fp16)) if precision.loss_scaling
                  else LossScaler.disabled)
        units = UnitSettings(prefetch_numel=zero.stage3_prefetch_bucket_size,
                             max_live_numel=zero.stage3_max_live_parameters,
                             max_reuse_numel=zero.stage3_max_reuse_distance, order_check=debug.unit_order_check,
                             access_check=debug.sharded_access_check, overlap=zero.overlap_comm)
        return cls(sharding=sharding, precision=precision, unit_classes=tuple(config.zerodist.stage3_unit_classes),
                   persistence_threshold=zero.stage3_param_persistence_threshold,
                   bucket_numel=bucket_capacity(zero.reduce_bucket_size, zero.allgather_bucket_size),
                   use_reduce_scatter=zero.reduce_scatter and sharding.shard_optimizer_state,
                   overlap=zero.overlap_comm, units=units, gradient_clipping=config.gradient_clipping,
                   loss_scaler=scaler, hierarchy=HierarchySettings.from_config(config),
                   layout_invariant=config.zerodist.deterministic == "layout_invariant")
