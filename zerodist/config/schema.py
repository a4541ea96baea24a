"""The typed config: one frozen pydantic model per section of DeepSpeed's JSON format.

Keys, nesting and defaults follow DeepSpeed so its configs load unchanged; the one exception
is the ``zerodist`` section for settings DeepSpeed has no key for. Every field carries a
one-line ``description``: ``docs/config.md`` is generated from it (see ``markdown.py``).

Models are frozen because the config is validated once and then sliced: the engine hands
``config.zero_optimization`` to ZeRO, ``config.fp16`` to the loss scaler, and no component
may change what another one sees.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from zerodist.config.monitor_sections import CometConfig, WandbConfig, check_monitor_packages
from zerodist.config.timeline_sections import FlopsProfilerConfig, ZerodistTimelineConfig
from zerodist.config.auto import TrainerValues, resolve_auto, resolve_model_auto
from zerodist.config.batch import BatchSizes, resolve_batch_sizes
from zerodist.config.deepspeed_keys import drop_no_op_keys, unalias_zero_keys
from zerodist.config.dotted_keys import expand_dotted_keys
from zerodist.config.errors import ConfigError
from zerodist.config.fields import BatchCount, ConstructorArgument, ElementCount, Section
from zerodist.config.offload_sections import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, offload_problems
from zerodist.config.problems import validation_problems
from zerodist.config.unknown_keys import validate
from zerodist.config.source import read_source
from zerodist.config.tensor_parallel_sections import TensorParallelConfig, ZerodistTensorParallelConfig
from zerodist.config.zeropp_sections import (
    CommunicationDataType,
    HierarchicalShardingKeys,
    HsdpConfig,
    apply_hsdp_alias,
    communication_dtype_problem,
    zeropp_problems,
)


_ELEMENT_COUNT_FIELDS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
)
_BATCH_FIELDS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


class OptimizerConfig(Section):
    type: str = Field(
        min_length=1,
        description='Optimizer class name, e.g. "AdamW"; the engine checks it against torch.optim.',
    )
    params: dict[str, ConstructorArgument] = Field(
        default_factory=dict, description='Keyword arguments of the optimizer, e.g. {"lr": 0.001}; each name '
        'and value type is checked against the class\'s constructor (a bool for "lr", one beta, is an error).'
    )


class SchedulerConfig(Section):
    type: str = Field(min_length=1, description='Learning-rate scheduler name, e.g. "WarmupLR".')
    params: dict[str, ConstructorArgument] = Field(
        default_factory=dict, description="Keyword arguments of the scheduler; each name and value type is "
        "checked against the class's constructor."
    )


class Fp16Config(Section):
    enabled: bool = Field(
        False,
        description="Train with fp16 weights and gradients, fp32 master weights and loss scaling.",
    )
    loss_scale: float = Field(
        0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: int = Field(
        16, ge=0, description="Dynamic loss scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: int = Field(
        1000, ge=1, description="Overflow-free steps before the dynamic scale doubles."
    )
    hysteresis: int = Field(
        2, ge=1, description="Overflows tolerated before the dynamic scale halves."
    )
    min_loss_scale: float = Field(
        1.0, gt=0, description="The dynamic scale never drops below this."
    )


class Bf16Config(Section):
    enabled: bool = Field(
        False, description="Train with bf16 weights and gradients and fp32 master weights."
    )


class ZeroConfig(HierarchicalShardingKeys):
    stage: int = Field(
        0,
        ge=0,
        le=3,
        description="1 shards optimizer state, 2 also gradients, 3 also parameters; 0 none.",
    )
    reduce_scatter: bool = Field(
        True, description="Reduce gradients with reduce-scatter; false runs all-reduce."
    )
    overlap_comm: bool = Field(
        True, description="Overlap communication with computation: reduce each gradient bucket as soon as it "
        "is full, while backward still runs, and (stages 1-2) all-gather the updated parameters during the "
        "next forward, each unit's waited for just before it runs; false reduces every bucket after backward "
        "and gathers at the end of step() (same collectives, same order, same results)."
    )
    contiguous_gradients: bool = Field(
        True, description="Gradients are copied into flat contiguous buckets as they are produced; zerodist "
        "always does this, so false (DeepSpeed's separate gradient tensors, a memory layout) is accepted and "
        "changes nothing, with one info line."
    )
    reduce_bucket_size: ElementCount = Field(
        500_000_000, description="Elements per gradient bucket, at every stage; buckets hold at most "
        "min(reduce_bucket_size, allgather_bucket_size)."
    )
    allgather_bucket_size: ElementCount = Field(
        500_000_000, description="Elements per parameter all-gather bucket; a bucket is gathered as it "
        "was reduced, so this caps buckets at every stage too."
    )
    stage3_prefetch_bucket_size: ElementCount = Field(
        50_000_000, description="Stage 3: parameter elements gathered ahead of use."
    )
    stage3_param_persistence_threshold: ElementCount = Field(
        100_000, description="Stage 3: parameters smaller than this stay unsharded. Every stage flattens "
        "them apart from the units, so that its buckets match stage 3's."
    )
    stage3_max_live_parameters: ElementCount = Field(
        1_000_000_000, description="Stage 3: most gathered parameter elements alive at once."
    )
    stage3_max_reuse_distance: ElementCount = Field(
        1_000_000_000,
        description="Stage 3: keep a unit gathered from its forward to its backward when fewer "
        "parameter elements than this are used in between (0: always free it after forward).",
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Per-element optimizer state on the host or in swap files (DeepSpeed's "
        "ZeRO-Offload / ZeRO-Infinity keys); null or device none keeps it in memory. See docs/offload.md."
    )
    offload_param: OffloadParamConfig | None = Field(
        None, description="Stage 3: parameter shards on the host or in swap files; null or device none keeps "
        "them in memory."
    )
    sub_group_size: ElementCount = Field(
        1_000_000_000, description="Elements of optimizer state stepped (and, with nvme offload, swapped) at a "
        "time; the result is the same for any size (the optimizer is elementwise)."
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="Stage 3: engine.save_16bit_model gathers the full 16-bit weights. zerodist's "
        "always gathers them (DeepSpeed's true), whatever this says."
    )

    @field_validator(*_ELEMENT_COUNT_FIELDS, mode="before")
    @classmethod
    def _resolve_element_count(cls, value: Any, info: Any) -> Any:
        if isinstance(value, str) and value == "auto":
            return cls.model_fields[info.field_name].default
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class CommsLoggerConfig(Section):
    enabled: bool = Field(
        False, description="Record every collective: op, bytes, time and bandwidth."
    )
    verbose: bool = Field(
        False, description="Log each collective as it runs, not only the summary."
    )
    prof_all: bool = Field(True, description="Record all collectives; false records only prof_ops.")
    prof_ops: list[str] = Field(
        default_factory=list,
        description='Collectives recorded when prof_all is false, e.g. ["all_reduce"].',
    )


class CheckpointConfig(Section):
    tag_validation: Literal["Ignore", "Warn", "Fail"] = Field(
        "Warn", description="What happens when ranks save under different tags."
    )
    auto_resume: bool = Field(
        False, description="Resume from the newest complete checkpoint in save_dir at start-up."
    )
    save_interval: int = Field(
        0, ge=0, description="Save every this many optimizer steps; 0 never saves on its own."
    )
    save_dir: str | None = Field(
        None,
        description="Directory for checkpoints saved by save_interval and read by auto_resume.",
    )
    keep_last: int = Field(
        0, ge=0, description="Keep only this many newest checkpoints in save_dir; 0 keeps all."
    )
    max_failed_saves: int = Field(
        3, ge=1, description="This many interval saves failing in a row stop training with the error (each "
        "failure before that warns on every rank; training goes on and retries at the next interval; a "
        "successful save resets the count); 1 stops at the first failure.",
    )
    skip_damaged: bool = Field(
        False, description="Load the newest intact checkpoint when a newer one is damaged; false makes that an "
        "error naming both.",
    )
    agreement_timeout: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="Seconds a save waits for every rank to call it; null means the collective timeout.",
    )


class MonitorConfig(Section):
    enabled: bool = Field(
        False, description="Write loss, learning rate and (under fp16) loss scale with this monitor."
    )
    output_path: str = Field(
        "", description="Directory the monitor writes under; empty means the working directory."
    )
    job_name: str = Field("DeepSpeedJobName", description="Subdirectory for this run.")


class PipelineSectionConfig(Section):
    """DeepSpeed's "pipeline" section (its other keys change nothing here: deepspeed_keys.py)."""

    activation_checkpoint_interval: int = Field(
        0, ge=0, description="A PipelineModule recomputes its activations in the backward pass, every this many "
        "layers of a stage's forward (DeepSpeed's meaning; > 0 overrides the module's own interval); 0 leaves the "
        "module's."
    )
    use_reentrant: bool | None = Field(
        None, description="false: the PipelineModule checkpoints with the non-reentrant function "
        "(deepspeed.checkpointing.non_reentrant_checkpoint); true or null: the module's (by default the reentrant "
        "deepspeed.checkpointing.checkpoint)."
    )


class DebugConfig(Section):
    collective_guard: bool = Field(
        False, description="Before each collective, check all ranks call the same op and shapes."
    )
    nan_check: bool = Field(
        False, description="Raise at the first NaN or Inf in a loss or gradient, naming it."
    )
    unit_order_check: bool = Field(
        True,
        description="Stage 3: ranks compare which unit each collective is for, so divergent "
        "control flow is a named error instead of a hang. Off at one rank; on a GPU each comparison "
        "waits for the device once per batch of gathers.",
    )
    sharded_access_check: bool = Field(
        True,
        description="Stage 3: using a sharded parameter's values outside a gather raises an error "
        "naming it, instead of reading NaN; costs about 2 us per torch call made between engine calls.",
    )


class ZerodistPipelineConfig(Section):
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"] = Field(
        "1f1b", description="Pipeline schedule (a PipelineModule's model): gpipe, 1f1b (DeepSpeed's), interleaved "
        "(needs stages_per_rank >= 2), zb (zero-bubble ZB-H1), zbv or dualpipev (ZB-V and DualPipeV: two stages "
        "per rank in a V, PipelineModule(stages_per_rank=2, stage_placement='v'))."
    )
    stages_per_rank: int | None = Field(
        None, ge=1, description="Pipeline stages on each pipe rank (interleaved); null takes the PipelineModule's."
    )
    timeout: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Seconds a pipeline stage waits for a neighbour's message before a named error; null "
        "means zerodist.timeout, else 600 s."
    )
    max_active_stages: int | None = Field(
        None, ge=1, description="ZeRO-3 with a pipeline: the most of a rank's stages gathered at once (the next ones its "
        "schedule computes; a stage may be gathered again later); null gathers each stage before its first compute "
        "and frees it after its last."
    )


class ZerodistSequenceParallelConfig(Section):
    method: Literal["ulysses", "ring", "manual"] = Field(
        "ulysses", description="Sequence-parallel attention: ulysses (all-to-all sequence <-> heads; the degree must "
        "divide the heads), ring (blockwise, merged by log-sum-exp; any degree, causal head-tail balance), or manual "
        "(DeepSpeed's: the engine makes the sequence groups, engine.seq_parallel_group, and the script shards its "
        "sequence and calls the exchanges itself)."
    )


class ZerodistConfig(Section):
    hsdp: HsdpConfig | None = Field(
        None, description="FSDP2's names for hierarchical sharding: {shard_degree, replicate_degree}, mapped onto "
        "zero_optimization.mics_shard_size (docs/zeropp.md)."
    )
    simulated_nodes: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Let one machine stand for this many nodes of world_size / simulated_nodes consecutive "
        "ranks (tests, benchmarks, `zerodist train --nnodes-sim`): the tracer files bytes as intra- or inter-node "
        "by it, and hierarchical sharding places its groups by it. null: the launcher's LOCAL_WORLD_SIZE (or "
        "ZERODIST_SIMULATED_NODES)."
    )
    timeout: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="Seconds a collective may wait before failing with a named error, and ranks may wait for each "
                    "other to join; null means 600 s for collectives and 300 s for joining.",
    )
    hang_warning: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="Seconds a rank waits in a collective before it logs which ranks have not arrived and where "
                    "they are; null means ZERODIST_HANG_WARNING, else 15 s.",
    )
    nonfinite_gradients: Literal["skip", "raise"] = Field(
        "skip",
        description="fp32/bf16: when any rank's gradients hold NaN/Inf, every rank skips the step with a warning "
                    "naming the rank(s) (skip), or raises NonFiniteError (raise). fp16 skips and lowers its loss scale.",
    )
    deterministic: Literal["off", "layout_invariant"] = Field(
        "off",
        description="layout_invariant: parameters, optimizer state and losses bitwise identical for every data "
                    "degree x accumulation with the same product (powers of two), ZeRO stage 0-3 and one process "
                    "(docs/determinism.md); off: the default arithmetic.",
    )
    debug: DebugConfig = Field(
        default_factory=DebugConfig, description="Checks that trade speed for early, named errors."
    )
    tensor_parallel: ZerodistTensorParallelConfig = Field(
        default_factory=ZerodistTensorParallelConfig,
        description="Tensor parallelism settings DeepSpeed has no key for (sequence parallelism, Domino).",
    )
    sequence_parallel: ZerodistSequenceParallelConfig = Field(
        default_factory=ZerodistSequenceParallelConfig,
        description="Sequence parallelism settings DeepSpeed has no key for (the attention method).",
    )
    pipeline: ZerodistPipelineConfig = Field(
        default_factory=ZerodistPipelineConfig,
        description="Pipeline parallelism settings for a zerodist.pipe.PipelineModule (its num_stages is the degree).",
    )
    timeline: ZerodistTimelineConfig = Field(
        default_factory=ZerodistTimelineConfig,
        description="A timeline of chosen steps: every rank's compute and communication on one clock (docs/timeline.md).",
    )
    unknown_keys: Literal["error", "warn"] | None = Field(
        None, description="An unknown key: refused (error), or, where DeepSpeed ignores it (top level, optimizer, "
        "scheduler, checkpoint, pipeline, flops_profiler), dropped with one warning (warn). null: "
        "ZERODIST_UNKNOWN_KEYS, else error (docs/integrations.md).")
    stage3_unit_classes: list[str] = Field(
        default_factory=list,
        description="Stage 3: module class names that each form one gather unit; empty picks each "
        "ModuleList item holding at least 5% of the parameters. Every stage flattens one group per unit, "
        "so that its buckets match stage 3's.",
    )


def precision_conflict(fp16_enabled: Any, bf16_enabled: Any) -> str | None:
    """The error for fp16 and bf16 both on, or None. Shared by validation and ``load``."""
    if fp16_enabled is True and bf16_enabled is True:
        return "'fp16.enabled' and 'bf16.enabled' are both true; choose one precision"
    return None


class Config(Section):
    """The whole config. Build it with ``Config.load``; read sections as attributes."""

    train_batch_size: BatchCount = Field(
        None, description="Samples per optimizer step over all data-parallel ranks."
    )
    train_micro_batch_size_per_gpu: BatchCount = Field(
        None, description="Samples per rank in one forward and backward."
    )
    gradient_accumulation_steps: BatchCount = Field(
        None, description="Micro-batches accumulated per optimizer step."
    )
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer the engine builds; absent when you pass your own."
    )
    scheduler: SchedulerConfig | None = Field(
        None, description="Learning-rate scheduler the engine builds; absent for none."
    )
    gradient_clipping: float = Field(
        0.0, ge=0, description="Clip gradients to this global L2 norm; 0 turns clipping off."
    )
    steps_per_print: Annotated[int, Field(ge=1)] | None = Field(
        10, description="Log progress every this many optimizer steps; Infinity or null never logs (accelerate "
        "sends Infinity)."
    )
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward and step and log the breakdown."
    )
    memory_breakdown: bool = Field(
        False, description="Log allocated and peak device memory at each log step."
    )
    fp16: Fp16Config = Field(
        default_factory=Fp16Config, description="fp16 mixed precision with loss scaling."
    )
    bf16: Bf16Config = Field(default_factory=Bf16Config, description="bf16 mixed precision.")
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig, description="ZeRO sharding and gradient buckets."
    )
    comms_logger: CommsLoggerConfig = Field(
        default_factory=CommsLoggerConfig, description="The communication tracer."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint saving and resuming."
    )
    csv_monitor: MonitorConfig = Field(
        default_factory=MonitorConfig, description="Training metrics as CSV files."
    )
    tensorboard: MonitorConfig = Field(
        default_factory=MonitorConfig, description="Training metrics as TensorBoard events."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Training metrics to Weights & Biases.")
    comet: CometConfig = Field(default_factory=CometConfig, description="Training metrics to Comet.")
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="Tensor parallelism (DeepSpeed AutoTP's keys)."
    )
    pipeline: PipelineSectionConfig = Field(
        default_factory=PipelineSectionConfig, description="DeepSpeed's pipeline section: a PipelineModule's "
        "activation checkpointing."
    )
    communication_data_type: CommunicationDataType | None = Field(
        None, description="The data type gradients are reduced in (DeepSpeed's key): fp32 reduces bf16/fp16 "
        "gradients in fp32 for accuracy (twice the bytes), and the result is cast back; null reduces in the "
        "gradients' own type."
    )
    sequence_parallel_size: int = Field(
        1, ge=1, description="Sequence-parallel degree (DeepSpeed-Ulysses' key): ranks that split each sample's "
        "sequence; ZeRO shards and reduces over data x sequence. 1 turns it off."
    )
    aio: AioConfig = Field(
        default_factory=AioConfig, description="DeepSpeed's libaio tuning (NVMe offload): type-checked, then "
        "ignored; zerodist's swap files use their own threads."
    )
    flops_profiler: FlopsProfilerConfig = Field(
        default_factory=FlopsProfilerConfig, description="FLOPs per step and module, FLOP/s and MFU (DeepSpeed's keys)."
    )
    zerodist: ZerodistConfig = Field(
        default_factory=ZerodistConfig, description="zerodist settings DeepSpeed has no key for."
    )

    @model_validator(mode="before")
    @classmethod
    def _hsdp_is_mics(cls, data: Any) -> Any:
        return apply_hsdp_alias(data)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_means_never(cls, value: Any) -> Any:
        return None if isinstance(value, float) and value == float("inf") else value

    @field_validator(*_BATCH_FIELDS, mode="before")
    @classmethod
    def _auto_means_absent(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value == "auto" else value

    @model_validator(mode="after")
    def _monitor_packages_installed(self) -> Config:
        check_monitor_packages(self.wandb, self.comet)
        return self

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        conflict = precision_conflict(self.fp16.enabled, self.bf16.enabled)
        if conflict:
            raise ValueError(conflict)
        return self

    @model_validator(mode="after")
    def _asks_only_for_what_runs(self) -> Config:
        """Values that ask for behaviour zerodist lacks are refused, saying what it does instead."""
        zero, problems = self.zero_optimization, []
        problems += offload_problems(zero.stage, zero.offload_optimizer, zero.offload_param)
        problems += zeropp_problems(zero, zero.stage, zero.reduce_scatter)
        dtype_problem = communication_dtype_problem(self.communication_data_type, self.fp16.enabled, self.bf16.enabled)
        if dtype_problem:
            problems.append(dtype_problem)
        if zero.mics_shard_size == 0:
            problems.append("'zero_optimization.mics_shard_size' is 0; give a positive shard group size, or -1 to "
                            "shard over every data-parallel rank")
        if zero.zero_hpz_partition_size > 1 and zero.offload_param is not None and zero.offload_param.device != "none":
            problems.append("'zero_optimization.zero_hpz_partition_size' keeps a secondary copy of the parameters in "
                            "device memory, but 'zero_optimization.offload_param' moves them off it; use one of the two")
        if zero.mics_shard_size > 1 and zero.stage == 0:
            problems.append("'zero_optimization.mics_shard_size' shards model states, but 'zero_optimization.stage' "
                            "is 0; set a stage of 1-3 or remove mics_shard_size")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _checkpoint_needs_save_dir(self) -> Config:
        wanted = [key for key in ("save_interval", "auto_resume") if getattr(self.checkpoint, key)]
        if wanted and self.checkpoint.save_dir is None:
            raise ValueError(f"'checkpoint.{wanted[0]}' is set but 'checkpoint.save_dir' is not; name the directory")
        return self

    @model_validator(mode="after")
    def _one_tensor_degree(self) -> Config:
        size = self.zerodist.tensor_parallel.size
        if size is not None and self.tensor_parallel.autotp_size not in (1, size):
            raise ValueError(f"'tensor_parallel.autotp_size' ({self.tensor_parallel.autotp_size}) and "
                             f"'zerodist.tensor_parallel.size' ({size}) disagree; give one of them")
        return self

    @property
    def tensor_degree(self) -> int:
        """The tensor-parallel degree from either key (1 when neither is set)."""
        return self.zerodist.tensor_parallel.size or self.tensor_parallel.autotp_size

    @classmethod
    def load(cls, source: Config | Mapping[str, Any] | str | os.PathLike[str], *,
             auto: TrainerValues | None = None, hidden_size: int | None = None) -> Config:
        """Validate a dict, or a JSON file at a path; a Config is returned as is.

        ``auto``: fill each ``"auto"`` from these values first, as Hugging Face's Trainer does
        (auto.py). Without it, ``"auto"`` is accepted only where the model, the batch or a default
        decides it: ``hidden_size`` (the model's, when it has one) fills the bucket sizes by the
        Trainer's formulas, the batch triple derives its missing member, and the other bucket
        sizes take their defaults.
        Raises ConfigError listing every problem, one line each; never pydantic's raw error.
        """
        if isinstance(source, Config):
            return source
        raw, source_name = read_source(source)
        raw, dotted_problems = expand_dotted_keys(raw, cls)  # TRL's "zero_optimization.x": [Note: dotted keys]
        if auto is not None:
            raw = resolve_auto(raw, auto, source=source_name)
        else:
            raw = resolve_model_auto(raw, hidden_size)
        raw, alias_problems = unalias_zero_keys(raw)  # DeepSpeed's un-prefixed ZeRO-3 names
        raw = drop_no_op_keys(raw)  # DeepSpeed keys set to values that change nothing here
        if alias_problems or dotted_problems:
            raise ConfigError(dotted_problems + alias_problems, source=source_name)
        try:
            return validate(cls, raw, source_name)  # refuses unknown keys, or drops DeepSpeed's ignored ones
        except ValidationError as error:
            problems = validation_problems(error, cls)
            # A failed field skips the model validator; check the raw sections so the
            # conflict is still reported in the same round.
            conflict = precision_conflict(_raw_enabled(raw, "fp16"), _raw_enabled(raw, "bf16"))
            if conflict:
                problems.append(conflict)
            raise ConfigError(list(dict.fromkeys(problems)), source=source_name) from None

    def batch_sizes(self, world_size: int, *, world_size_source: str) -> BatchSizes:
        """The batch triple resolved for ``world_size`` data-parallel ranks (see batch.py).

        ``world_size_source`` says where the number came from (``"WORLD_SIZE=2"``) so an
        inconsistent triple's error can say which number to change.
        """
        return resolve_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size=world_size,
            world_size_source=world_size_source,
        )

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, defaults filled in, as JSON-compatible types."""
        return self.model_dump(mode="json")

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key's JSON value: DeepSpeed's `engine.config` is the config dict, and callers such
        as transformers' Trainer read it so (`engine.config.get("zero_optimization", {})`)."""
        return self.to_dict().get(key, default)


def _raw_enabled(raw: Mapping[str, Any], section: str) -> Any:
    value = raw.get(section)
    return value.get("enabled") if isinstance(value, Mapping) else None
