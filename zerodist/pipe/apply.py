"""Pipeline parallelism's front door: `apply_pipeline` -> `PipelineState`, a part state like the others.

    pipeline = apply_pipeline(model, topology, PipelineSettings.from_config(config), micro_batches)
    part, = pipeline.parts              # this rank's stages (one part: one flat layout, one optimizer)
    ... tensor -> sequence -> expert -> ZeRO on the part ...
    pipeline.check_tied_layers_kept()   # after tensor parallelism swapped layers
    engine = Engine(..., runner=PipelineRunner(pipeline))

[Note: tied slices] Tensor parallelism runs after the pipeline and may swap a tied layer for its
slice: Hugging Face GPT-2's `wte` becomes a vocab-parallel embedding on the first stage and, on the
last, the same (registered there under the tie's first name) with `lm_head` a head over its slice.
The copies are then this tensor rank's rows of the vocabulary on both stages, and the tie groups
pair exactly the ranks of one tensor index (the topology's pipe groups), so the tie holds on the
slices: `check_tied_layers_kept` moves the tie's hooks to them (`TiedGradients.rebind`). They were
made equal before the swap (`sync_weights` on the whole weights), so the slices start equal.

It runs first in the recipe (validate -> topology -> split into parts -> per part the techniques)
because a `PipelineModule` arrives already split: each rank built only the layers of its own
stages. The state holds what the pipeline needs from then on: the tie groups (their ranks from the
`Topology`'s pipe groups), the schedule and its simulation, the executor. It knows nothing of ZeRO:
the engine's runner drives the unit runtime around the executor (zerodist/engine/pipeline.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.parts import Part, split_parts
from zerodist.comm.topology import axis_partition
from zerodist.config import Config
from zerodist.pipe.executor import PipelineError, PipelineExecutor, RunResult
from zerodist.pipe.module import PipelineModule
from zerodist.pipe.executor import check_module_for_schedule
from zerodist.pipe.schedule import Action, Schedule, add_sharding, build_schedule, forward_only, stage_to_rank
from zerodist.pipe.schedule_checks import SimulationResult, check_schedule
from zerodist.pipe.tied import TiedGradients

__all__ = ["PipelineSettings", "PipelineState", "apply_pipeline", "pipe_degree_of", "pipeline_fingerprint",
           "tie_group_ranks"]


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline takes from the config (`from_config`)."""

    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: the PipelineModule's
    timeout_s: float | None = None  # the wait for a neighbour's message; None: the process group's
    timeout_setting: str = "zerodist.pipeline.timeout"  # named by a timeout's error
    max_active_stages: int | None = None  # stage 3: virtual stages gathered at once (None: every one in flight)
    activation_checkpoint_interval: int = 0  # DeepSpeed's "pipeline" section: > 0 overrides the module's
    use_reentrant: bool | None = None  # False: the module checkpoints with non_reentrant_checkpoint

    @classmethod
    def from_config(cls, config: Config) -> PipelineSettings:
        section = config.zerodist.pipeline
        timeout, setting = section.timeout, "zerodist.pipeline.timeout"
        if timeout is None:
            timeout, setting = config.zerodist.timeout, "zerodist.timeout (zerodist.pipeline.timeout unset)"
        if timeout is None:
            setting = "ZERODIST_TIMEOUT, else 600 s (zerodist.pipeline.timeout and zerodist.timeout unset)"
        return cls(section.schedule, section.stages_per_rank, timeout, setting, section.max_active_stages,
                   config.pipeline.activation_checkpoint_interval, config.pipeline.use_reentrant)


def pipe_degree_of(model: torch.nn.Module) -> int:
    """The pipe axis' degree a model asks for: a PipelineModule's stages, else 1."""
    return model.num_stages if isinstance(model, PipelineModule) else 1


def pipeline_fingerprint(model: torch.nn.Module) -> list[Any] | None:
    """What every rank of a pipeline must agree on (each holds other layers): the whole plan."""
    if not isinstance(model, PipelineModule):
        return None
    return [model.num_stages, model.stages_per_rank, model.parts, model.layer_classes,
            sorted((k, v) for k, v in model.tied_keys.items())]


def tie_group_ranks(module: PipelineModule, topology: comm.Topology) -> dict[str, list[list[int]]]:
    """For each tied key that two pipe ranks or more hold: the global ranks of each tie group, one
    group per pipe group of the topology (its members in pipe order), in one order on every rank."""
    pipe_groups = axis_partition(topology.degrees, ("pipe",))
    result: dict[str, list[list[int]]] = {}
    for key in sorted(module.tied_keys):
        pipe_ranks = sorted({stage_to_rank(s, module.num_stages, module.stage_placement) for s in module.tied_keys[key]})
        if len(pipe_ranks) >= 2:
            result[key] = [[members[r] for r in pipe_ranks] for members in pipe_groups]
    return result


@dataclasses.dataclass
class PipelineState:
    """What pipeline parallelism did to the model on this rank: the part state surface of
    zerodist/comm/parts.py, and what a batch needs (schedule, executor, tie groups)."""

    module: PipelineModule
    topology: comm.Topology
    settings: PipelineSettings
    micro_batches: int
    schedule: Schedule  # every pipe rank's actions, sharding actions included
    simulated: SimulationResult  # the schedule's bubble and stashed activations (F=I=W=1, B=2)
    executor: PipelineExecutor
    tied: TiedGradients | None
    last_run: RunResult | None = None

    @property
    def parts(self) -> list[Part]:
        """The parts this rank holds: its stages, as one part."""
        return split_parts(self.module, self.module.num_stages, self.pipe_rank)

    @property
    def pipe_ranks(self) -> list[int]:
        return self.topology.ranks("pipe")

    @property
    def pipe_rank(self) -> int:
        return self.topology.axis_rank("pipe")

    def is_first_stage(self) -> bool:
        return self.pipe_rank == 0

    def is_last_stage(self) -> bool:  # holds the last stage: the last pipe rank, rank 0 in a V
        return self.module.total_stages - 1 in self.module.local_stages

    def actions(self, micro_batches: int | None = None, train: bool = True) -> list[Action]:
        """This rank's actions for a batch of `micro_batches` (default the training batch's), with
        its stages' UNSHARD / RESHARD / REDUCE_GRAD ([Note: sharding actions] in schedule.py); the
        forwards, their messages and their gathers only when not training."""
        count = micro_batches or self.micro_batches
        if train and count == self.micro_batches:
            return self.schedule[self.pipe_rank]
        plain = _build(self.module, self.settings, count, sharding=False)
        return add_sharding(plain if train else forward_only(plain),
                            max_active_stages=self.settings.max_active_stages)[self.pipe_rank]

    def check_tied_layers_kept(self) -> None:
        """After tensor parallelism ([Note: tied slices]): a tied parameter its plan swapped for a
        slice is tied again on the slice when the stage module holds it under the tie's name (a
        model cut by `split_model`); one it cannot find would leave the tie's hooks on parameters
        nobody trains (the copies would drift apart unseen), so that is refused by name."""
        if self.tied is None:
            return
        live = {id(p) for p in self.module.parameters()}

        def swapped() -> list[str]:
            assert self.tied is not None
            return sorted(key for key, params in self.tied.parameters_by_key.items()
                          if any(id(p) not in live for p in params))
        if not swapped():
            return
        self.tied.rebind()
        if swapped():
            raise PipelineError(f"tensor parallelism replaced the tied layer(s) {swapped} of this PipelineModule; "
                                "tied layers cannot be tensor-parallel yet: leave them out of the plan (or untie them)")

    # ------------------------------------------------------------------ the part-state surface
    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state  # a stage keeps the model's names ([Note: pipeline state-dict keys] in module.py)

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def report(self) -> list[str]:
        module = self.module
        return [f"pipeline: pipe rank {self.pipe_rank} of {module.num_stages}, stage(s) {module.local_stages} of "
                f"{module.total_stages}, schedule {self.settings.schedule} over {self.micro_batches} micro-batch(es), "
                f"simulated idle share {self.simulated.idle_share:.3f}"
                + (f", {len(self.tied.groups)} tied key(s)" if self.tied is not None and self.tied.active else "")]

    def remove_hooks(self) -> None:
        if self.tied is not None:
            self.tied.remove_hooks()


def _build(module: PipelineModule, settings: PipelineSettings, micro_batches: int, *, sharding: bool) -> Schedule:
    return build_schedule(settings.schedule, num_ranks=module.num_stages, num_microbatches=micro_batches,
                          stages_per_rank=module.stages_per_rank, with_sharding=sharding,
                          max_active_stages=settings.max_active_stages)


def apply_pipeline(model: torch.nn.Module, topology: comm.Topology, settings: PipelineSettings,
                   micro_batches: int) -> PipelineState | None:
    """A PipelineModule's pipeline on this rank (None for any other model): its tie groups made and
    every tied copy given the lowest stage's values (before ZeRO flattens them), the schedule built
    and proved (`check_schedule`), the executor over the topology's pipe group. Refusals come
    before any collective, alike on every rank."""
    if not isinstance(model, PipelineModule):
        return None
    if comm.device_for_rank().type != "cpu" and len(topology.ranks("pipe")) > 1:
        # [Note: p2p on NCCL] in zerodist/comm/p2p.py: stages on one rank exchange no message and run on
        # any device; messages between ranks on NCCL are not yet proven free of deadlock. Refused by name.
        raise PipelineError(f"pipeline parallelism across ranks runs on the CPU with gloo in this version; this "
                            f"rank computes on {comm.device_for_rank()} (NCCL), where stage-to-stage messages are not "
                            "supported yet: train the PipelineModule on gloo, put all its stages on one rank "
                            "(pipe degree 1, stages_per_rank > 1), or train without a pipeline")
    if settings.stages_per_rank not in (None, model.stages_per_rank):
        raise ValueError(f"zerodist.pipeline.stages_per_rank is {settings.stages_per_rank} but the "
                         f"PipelineModule was built with stages_per_rank={model.stages_per_rank}; give the "
                         "same number to both (the module needs it to place its layers)")
    model.configure_checkpointing(settings.activation_checkpoint_interval, settings.use_reentrant)
    check_module_for_schedule(model, settings.schedule)
    schedule = _build(model, settings, micro_batches, sharding=True)
    simulated = check_schedule(schedule, num_microbatches=micro_batches, num_stages=model.total_stages)
    executor = PipelineExecutor(model, topology.ranks("pipe"), timeout_s=settings.timeout_s,
                                timeout_setting=settings.timeout_setting)
    tied = TiedGradients(model, tie_group_ranks(model, topology))
    tied.sync_weights()
    return PipelineState(model, topology, settings, micro_batches, schedule, simulated, executor, tied)
