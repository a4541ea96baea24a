"""The Engine: forward, backward, step for a model under ZeRO. It composes, it does not implement.

    engine(batch) -> loss;  engine.backward(loss);  engine.step()

The engine is an `nn.Module` whose one submodule is the user's model, `module` (as DeepSpeed's
engine is): `parameters()`, `named_parameters()` and `state_dict()` are nn.Module's, so their
names carry the `module.` prefix; `module_state_dict()` gives the plain model's keys. The
engine's own training state (counters, scheduler, loss scale) is not part of `state_dict()`;
`save_checkpoint()` holds it. docs/deepspeed.md lists DeepSpeed's engine API, name by name.

`step()` is called every micro-step; it steps the optimizer only at the gradient
accumulation boundary, which `is_gradient_accumulation_boundary()` states and
`set_gradient_accumulation_boundary()` can override.

`train_batch(data_iter)` runs a whole batch (gradient_accumulation_steps micro-batches and the
step) through the engine's batch runner (zerodist/engine/runners.py): the plain accumulation loop
by default, the schedule executor for a pipeline (zerodist/engine/pipeline.py), which also
refuses `forward` / `backward` / `step` as DeepSpeed's `PipelineEngine` does.

The techniques' states are kept by name in `part_states` (`zerodist.comm.parts.PartStates`):
the engine loops over it for the logical state dict, the loader, random streams, the step log,
hooks and close, and reads ZeRO's state (`part_states["zero"]`) under the names below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import zerodist.checkpoint as checkpoint
import zerodist.comm as comm
from zerodist.comm.parts import PartStates
from zerodist.config import BatchSizes, Config
from zerodist.debug import MemoryMonitor, NanHunter, NonFiniteError, reduce_loss
from zerodist.engine import training_state
from zerodist.engine.deepspeed_surface import DeepSpeedEngineAPI
from zerodist.engine.monitor import Monitors
from zerodist.engine.phase_timing import PhaseTiming
from zerodist.engine.pipeline_surface import PipelineEngineSurface
from zerodist.engine.runners import AccumulationRunner, BatchRunner
from zerodist.pipe.executor import PipelineError
from zerodist.utils import get_logger, log_rank0
from zerodist.zero import StepResult, UnitRuntime, ZeroState, canonical, sharded_access

logger = get_logger(__name__)


class Engine(PipelineEngineSurface, DeepSpeedEngineAPI, torch.nn.Module):
    """Made by `zerodist.initialize()`; wraps the user's module without changing its attributes.
    DeepSpeed's accessors (`train_batch_size()`, `local_rank`, ...) come from `DeepSpeedEngineAPI`."""

    # The loader initialize() returned, if any: checkpoints record and restore its position.
    training_dataloader: Any = None
    # train_batch()'s own iterator over that loader (repeated), made at its first call without data_iter
    own_data_iter: Iterator[Any] | None = None

    def __init__(self, module: torch.nn.Module, *, config: Config, batch: BatchSizes,
                 part_states: PartStates, lr_scheduler: Any, training_dataloader: Any = None,
                 runner: BatchRunner | None = None):
        super().__init__()  # nn.Module's bookkeeping first; `self.module = module` then registers the submodule
        self.module, self.config, self.batch, self.lr_scheduler = module, config, batch, lr_scheduler
        # One part today (zerodist/comm/parts.py): what each technique made of it, by name, and ZeRO's
        # state under the names the rest of the engine reads it by.
        self.part_states = part_states
        zero = part_states["zero"]
        assert isinstance(zero, ZeroState), "every part has a ZeRO state"
        self.zero_state = zero
        self.runner: BatchRunner = runner or AccumulationRunner()
        self.agg_train_loss: torch.Tensor | None = None  # the last train_batch()'s loss (DeepSpeed's name)
        self.policy, self.topology, self.sharding = zero.precision, zero.topology, zero.sharding
        self.groups, self.reducer, self.optimizer = zero.groups, zero.reducer, zero.optimizer
        self.units: UnitRuntime = zero.runtime  # the verbs a schedule calls: unshard, wait_unshard, reshard, ...
        self._record_world()
        self.stage = zero.sharding.stage  # DeepSpeed's number, for reports
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.interval_saves = checkpoint.IntervalSaves(config.checkpoint)  # a failed one warns; training goes on
        self._before_save: list[Callable[[], None]] = []  # before_interval_save()'s callbacks
        self.last_step: StepResult | None = None
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._backward_pending = False
        self._trace = None
        self._micro_losses: list[torch.Tensor] = []  # this optimizer step's losses, for the logged mean
        self.nan_hunter = NanHunter(self) if config.zerodist.debug.nan_check else None
        self.memory_monitor = MemoryMonitor(self) if config.memory_breakdown else None
        self.monitors = Monitors(config, comm.get_rank())  # csv_monitor / tensorboard / wandb / comet, by rank 0
        if config.comms_logger.enabled:
            ops = None if config.comms_logger.prof_all else config.comms_logger.prof_ops
            self._trace = comm.trace(ops=ops, verbose=config.comms_logger.verbose)
            self.comms_trace = self._trace.__enter__()
        # wall_clock_breakdown, flops_profiler, zerodist.timeline in the user's own loop (zerodist/engine/phase_timing.py)
        self.phase_timing = PhaseTiming(self)

    # ------------------------------------------------------------------ accumulation boundary
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force (True/False) or restore (None) the boundary decision for the next micro-steps."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates locally without reducing (stages 0 and 1 only)."""
        if self._coalescing:
            raise AssertionError("no_sync() cannot be nested inside coalesce_grad_reduction(): the block already "
                                 "accumulates locally and reduces once on exit")
        if self.sharding.shard_gradients:
            raise RuntimeError(f"no_sync() is not available at ZeRO stage {self.stage}: gradients are reduced into "
                               "shards as they are produced; use gradient_accumulation_steps instead")
        self._no_sync, previous = True, self._no_sync
        try:
            yield
        finally:
            self._no_sync = previous

    # ------------------------------------------------------------------ the training step
    # forward, backward and step run without the stage-3 access check: they gather what they use,
    # and a torch-function mode would cost every op (see [Note: sharded access check]).
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_in_pipeline_mode()
        # Right after a step (stages 1/2) the forward waits for each unit's gather in its pre-hook, and
        # a stray read of a buffer still being gathered waits too ([Note: overlapped parameter gather]).
        with self.phase_timing.phase("forward"), sharded_access.suspended(waiting=True):
            if self.policy.needs_master_copy:
                args, kwargs = _cast_floating((args, kwargs), self.policy.param_dtype)
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backward of `loss` scaled for accumulation (and fp16 loss scaling); gradients are
        reduced as buckets fill when this micro-step syncs."""
        self._refuse_in_pipeline_mode()
        # Autograd reads the parameters its graph saved: a graph kept from before the last step
        # (retain_graph) would otherwise read buffers still being gathered.
        with self.phase_timing.phase("backward"):
            self.finish_param_gathers()
            with sharded_access.suspended():
                self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward() takes the scalar loss, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        self.reducer.sync_enabled = self.sharding.shard_gradients or (
            self.is_gradient_accumulation_boundary() and not self._no_sync and not self._coalescing)
        # DeepSpeed's scale_wrt_gas=False: the script already divided its loss by the accumulation steps.
        scale = self.optimizer.scaler.scale / (self.batch.gradient_accumulation_steps if scale_wrt_gas else 1)
        scaled = loss.float() * scale if scale != 1.0 else loss
        seen = self.reducer.grads_seen
        scaled.backward(retain_graph=retain_graph)
        self.zero_state.schedule.end_backward()
        if self.reducer.grads_seen == seen:
            raise RuntimeError("engine.backward(): the loss produced no gradient for any trained parameter; "
                               "is it computed from engine(...)'s output?")
        self._micro_losses.append(loss.detach())
        if self.nan_hunter is not None:
            self.nan_hunter.check(loss)  # collective: every rank raises together, naming the first NaN/Inf
        self._backward_pending = True

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """One micro-step done; at the accumulation boundary, the optimizer steps."""
        self._refuse_in_pipeline_mode()
        self._refuse_in_coalescing("step()")
        with self.phase_timing.phase("step"), sharded_access.suspended():
            self._step(lr_kwargs or {})

    def _step(self, lr_kwargs: dict[str, Any]) -> None:
        if not self._backward_pending:
            raise RuntimeError("engine.step() without engine.backward(loss) since the last step: call "
                               "engine.backward(loss) (not loss.backward()) so gradients are scaled and reduced")
        self._backward_pending = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._step_applied = False
        if boundary:
            self._optimizer_step(lr_kwargs)

    def _refuse_in_coalescing(self, what: str) -> None:
        if self._coalescing:  # local state: every rank raises alike, before any collective
            raise AssertionError(f"It is illegal to call engine.{what} inside coalesce_grad_reduction() (DeepSpeed's "
                                 "no_sync context): call it after the with-block, whose exit reduces the gradients")

    def _refuse_in_pipeline_mode(self) -> None:
        if self.runner.only_train_batch:
            raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # ------------------------------------------------------------------ whole batches
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches from `data_iter` (by
        default the loader of `initialize(training_data=...)`, repeated); the batch's mean loss,
        the same on every rank. A pipeline's micro-batches are `(inputs, labels)`; otherwise each
        is the model's arguments (a dict as keywords, a tuple as positions) and its forward returns
        the loss (or an output with `.loss`)."""
        self._refuse_in_coalescing("train_batch()")
        with self.phase_timing.phase("train_batch"):
            return self.runner.train_batch(self, data_iter)

    def eval_batch(self, data_iter: Iterator[Any] | None = None, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forwards only over `num_micro_batches` (default gradient_accumulation_steps) micro-batches:
        the mean loss on every rank, and the outputs with `return_logits` (DeepSpeed's signature)."""
        return self.runner.eval_batch(self, data_iter, return_logits=return_logits, compute_loss=compute_loss,
                                      num_micro_batches=num_micro_batches)

    def apply_batch(self, losses: list[torch.Tensor], micro_batches: int) -> None:
        """A batch runner ran `micro_batches` forwards and backwards and reduced their gradients: count
        them and step the optimizer (the accumulation boundary); `losses` go to the step log."""
        self._micro_losses = list(losses)
        self.micro_steps += micro_batches
        self._step_applied = False
        with self.phase_timing.phase("step"), sharded_access.suspended():
            self._optimizer_step({})

    def _optimizer_step(self, lr_kwargs: dict[str, Any]) -> None:
        result = self.optimizer.step()
        self.last_step = result
        self._step_applied = not result.overflow
        self.global_steps += 1
        if result.overflow:
            self.skipped_steps += 1
            if result.nonfinite:
                self._skipped_nonfinite(result)
            else:
                log_rank0(logger, "step %d: gradient overflow on some rank; every rank skipped the step, loss scale "
                          "now %g", self.global_steps, self.optimizer.scaler.scale)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)
        self._report()
        self._save_at_interval()

    def _skipped_nonfinite(self, result: StepResult) -> None:
        """fp32/bf16: every rank skipped the step (the all-reduced norm was NaN/Inf); name the
        ranks (one collective, on this rare path only), then warn or raise, by config."""
        loss_bad = not all(bool(torch.isfinite(loss).all()) for loss in self._micro_losses)
        loss_ranks, shard_ranks = self.optimizer.ranks_where(loss_bad, result.nonfinite_here)
        where = (f"a non-finite loss on rank(s) {loss_ranks}" if loss_ranks else
                 f"finite losses, but non-finite gradients in the reduced shards of rank(s) {shard_ranks}")
        message = (f"step {self.global_steps}: {where} (gradient norm {result.grad_norm}); every rank skipped the "
                   f"step, the weights are unchanged ({self.skipped_steps} step(s) skipped so far)")
        if self.config.zerodist.nonfinite_gradients == "raise":
            raise NonFiniteError(f"{message}. zerodist.nonfinite_gradients is 'raise' ('skip' skips such steps with "
                                 "a warning); zerodist.debug.nan_check: true finds the first NaN/Inf", [])
        log_rank0(logger, "%s. zerodist.nonfinite_gradients: 'raise' makes this an error; zerodist.debug.nan_check: "
                  "true finds the first NaN/Inf", message, level=30)

    def _report(self) -> None:
        losses, self._micro_losses = self._micro_losses, []
        if self.memory_monitor is not None:
            self.memory_monitor.on_step(self.global_steps)
        every = self.config.steps_per_print or 0  # None: never (DeepSpeed's Infinity)
        printing = every > 0 and self.global_steps % every == 0
        if not (printing or self.monitors):
            return
        # The global batch's loss (mean over the data-parallel ranks and this step's micro-batches), not
        # rank 0's own: one scalar all_reduce, only on steps that report it.
        loss = self._logged_loss(losses)
        if self.monitors and comm.get_rank() == 0:
            self.monitors.write(self.global_steps * self.batch.train_batch_size, loss=loss, lr=self.get_lr()[0],
                                loss_scale=self.optimizer.scaler.scale)
        if not printing:
            return
        log_rank0(logger, "step %d: loss %.6g (mean over ranks), lr %s, grad norm %.4g, loss scale %g",
                  self.global_steps, loss, self.get_lr(), self.get_global_grad_norm() or 0.0,
                  self.optimizer.scaler.scale)
        for line in self.part_states.step_lines():  # MoE load balance, rank 0's last forward
            log_rank0(logger, "step %d: %s", self.global_steps, line)
        if self._trace is not None:
            log_rank0(logger, "communication so far:\n%s", self.comms_trace.format_summary())

    def _logged_loss(self, losses: list[torch.Tensor]) -> float:
        """The loss steps_per_print and the monitors report; in the layout-invariant mode the canonical
        average train_batch() returns (zerodist/zero/canonical.py), else the mean over ranks and micro-batches."""
        group = self.topology.group(*self.topology.batch_axes)
        if self.zero_state.optimizer.exact_norm:
            if self.runner.only_train_batch:  # a pipeline's: already the canonical average, on every rank
                return float(losses[0])
            if len(losses) == self.batch.gradient_accumulation_steps:
                return float(canonical.loss_mean(losses, group, accumulation=len(losses),
                                                 shard_gradients=self.sharding.shard_gradients))
        return reduce_loss(torch.stack(losses).float().mean(), group=group).item()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine already does this after each optimizer step); they
        are always dropped, whatever `set_to_none` says (nn.Module's signature)."""
        self.optimizer.zero_grad()

    def finish_param_gathers(self) -> None:
        """Wait for the last step's parameter all-gathers still in flight (overlap_comm; at stage 3 the
        next forward's first units, which stay placeholders until it: [Note: early gather]):
        the next forward waits for each unit's where it first uses them, and every other engine call
        that reads or writes parameters calls this first ([Note: overlapped parameter gather] in
        zerodist/zero/runtime.py)."""
        self.units.finish_gathers()

    @property
    def pipeline(self) -> Any:
        """The pipeline's state (`zerodist.pipe.apply.PipelineState`), None without a pipeline."""
        return self.part_states.get("pipe")

    @property
    def simulated(self) -> Any:
        """The pipeline schedule's simulation (bubble, stashed activations), None without a pipeline."""
        return None if self.pipeline is None else self.pipeline.simulated

    @property
    def last_run(self) -> Any:
        """The pipeline executor's last run (losses, peak stashed micro-batches, trace), if any."""
        return None if self.pipeline is None else self.pipeline.last_run

    def is_first_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_last_stage()

    @property
    def stage3(self) -> UnitRuntime | None:
        """The unit runtime when parameters are sharded (ZeRO stage 3), None otherwise."""
        return self.units if self.sharding.shard_parameters else None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Save everything needed to resume under `save_dir/tag` (default tag `global_step{N}`);
        collective: call it on every rank. Returns the checkpoint directory. See docs/checkpoints.md.
        DeepSpeed's signature; `exclude_frozen_parameters=True` is refused (the manifest holds every tensor)."""
        self.finish_param_gathers()
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True): zerodist checkpoints hold every "
                             "parameter, so any world size and stage can load them; leave it False")
        return checkpoint.save_checkpoint(self.zero_state, self, save_dir, settings=self.config.checkpoint, tag=tag,
                                          client_state=client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Load a checkpoint saved at any world size and ZeRO stage (default: the newest committed);
        collective. Returns `(load_path, client_state)`, `(None, None)` when there is none.
        DeepSpeed's signature; loading is always strict and `custom_load_fn` is refused."""
        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("load_checkpoint(load_module_strict=False / custom_load_fn=...): zerodist loads every "
                             "parameter by name, strictly; for a partial load, call model.load_state_dict(state, "
                             "strict=False) on the model before initialize()")
        self.units.finish_gathers(release=True)  # before loading overwrites the buffers they write
        return checkpoint.load_checkpoint(self.zero_state, self, load_dir, tag=tag,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only,
                                          skip_damaged=self.config.checkpoint.skip_damaged)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: the whole module in its training dtype in one file (safetensors if the name
        ends in .safetensors), gathered one unit at a time, written by rank 0; collective."""
        self.finish_param_gathers()
        return checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def training_state_dict(self) -> dict[str, Any]:
        """This rank's resumable training state: counters, loss scaler, scheduler, RNG, data position."""
        self.finish_param_gathers()
        return training_state.training_state_dict(self)

    def load_training_state_dict(self, state: dict[str, Any]) -> None:
        self.finish_param_gathers()
        training_state.load_training_state_dict(self, state)

    @contextlib.contextmanager
    def before_interval_save(self, callback: Callable[[], None]) -> Iterator[None]:
        """Inside: `callback()` runs after each optimizer step's update and before the interval save
        that step may make (every step, saving or not), e.g. to write a metrics row that a kill right
        after the save must not lose ([Note: rows before the save] in zerodist/train/loop.py)."""
        self._before_save.append(callback)
        try:
            yield
        finally:
            self._before_save.remove(callback)

    def _save_at_interval(self) -> None:
        for callback in list(self._before_save):
            callback()
        save_dir = self.config.checkpoint.save_dir  # the config requires it with save_interval
        self.interval_saves.after_step(self.global_steps, lambda: self.save_checkpoint(str(save_dir)))

    # ------------------------------------------------------------------ queries
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (before clipping), None before any step."""
        return None if self.last_step is None else self.last_step.grad_norm

    @property
    def loss_scale(self) -> float:
        return self.optimizer.scaler.scale

    def module_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The plain model's `state_dict()` (same keys), cloned; None off rank 0 with `rank0_only`.
        At stage 3 the parameters are gathered for it, and MoE experts are gathered from their
        expert groups under global ids, so the result loads into the same model built with
        `ep_size=1` (all ranks must call it together)."""
        state = self.zero_state.logical_state_dict()  # whole parameters (gathered at stage 3), cloned
        state = self.part_states.to_logical(state)  # tensor slices gathered, experts under global ids
        if rank0_only and comm.get_rank() != 0:
            return None
        return state

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state on this rank: parameters, gradients, optimizer (master + states)."""
        return self.zero_state.model_state_bytes()

    def destroy(self) -> None:
        """Finish the last step's parameter gathers, remove hooks and stop the comms trace; the module
        keeps working as a plain module."""
        self.units.finish_gathers(release=True)
        self.part_states.remove_hooks()  # ZeRO's hooks, MoE's routing clock, the pipeline's tie hooks
        if self.nan_hunter is not None:
            self.nan_hunter.close()
        self.monitors.close()
        self.phase_timing.close()
        for group in self.groups:
            group.release_pooled_buffers()  # stage 3's idle gathered/staging buffers ([Note: buffer pool])
        self.part_states.close()  # offload's swap files are scratch: removed here
        self._forget_process_groups()  # deepspeed.utils.groups stops answering from this engine
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj
