"""The pipeline engine: `train_batch(data_iter)` runs a schedule over a `PipelineModule`'s stages.

    engine, *_ = zerodist.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=...), config=...)
    loss = engine.train_batch(data_iter)      # gradient_accumulation_steps micro-batches, one step
    loss = engine.eval_batch(data_iter)

DeepSpeed's `PipelineEngine` surface: `forward`, `backward` and `step` raise `PipelineError`
("Only train_batch() is accessible in pipeline mode."); `train_batch` returns the batch's mean
loss on every rank (the last stage's, averaged over data-parallel ranks and broadcast over the
pipe).

[Note: pipeline under ZeRO] One batch is one `runtime.driven()` block of the unit runtime
([Note: driving the runtime] in zerodist/zero/runtime.py): every unit of this rank's stages is
gathered once (stage 3), every backward accumulates gradients locally (the reducer defers), and
after the last micro-batch the gradients are reduced once over the stage's own data-parallel
group (the flat groups hold only this stage's parameters, over groups that do not include the
pipe axis) and the units freed. So ZeRO 0-3 compose with the pipeline the way torch's FSDP2
does it (reduce-scatter deferred to the last micro-batch), and the sums are stage 0/1's local
accumulation. The optimizer's step agrees on the gradient norm and overflow over the world, so
every stage clips and skips alike. Tied layers (one module on several stages) have their reduced
gradients summed over the tie group before the step (`TiedGradients`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.engine.engine import Engine
from zerodist.engine.pipeline_surface import PipelineEngineSurface
from zerodist.pipe.executor import PipelineError, PipelineExecutor, RunResult
from zerodist.pipe.module import PipelineModule
from zerodist.pipe.schedule import Action, Kind, build_schedule
from zerodist.pipe.schedule_checks import check_schedule
from zerodist.pipe.tied import TiedGradients
from zerodist.zero import sharded_access

__all__ = ["PipelineEngine", "PipelineError", "check_tied_layers_kept", "discard_pipeline", "pipeline_fingerprint",
           "pipeline_split", "prepare_pipeline"]


# The tie groups made by `prepare_pipeline` (before ZeRO), for the engine built after it.
_TIED: weakref.WeakKeyDictionary[torch.nn.Module, TiedGradients] = weakref.WeakKeyDictionary()


def prepare_pipeline(model: torch.nn.Module, world_size: int) -> None:
    """Before ZeRO flattens the parameters: make the tie groups of a PipelineModule's tied layers
    and give every copy the lowest stage's values ([Note: tied gradients] in zerodist/pipe/tied.py)."""
    if isinstance(model, PipelineModule):
        tied = TiedGradients(model, world_size)
        tied.sync_weights()
        _TIED[model] = tied


def check_tied_layers_kept(model: torch.nn.Module) -> None:
    """After tensor parallelism: a tied layer its plan swapped for a parallel one would leave the tie's
    hooks on parameters nobody trains (the copies would drift apart unseen), so refuse it by name."""
    tied = _TIED.get(model)
    if tied is None:
        return
    live = {id(p) for p in model.parameters()}
    swapped = sorted(key for key, params in tied.parameters_by_key.items() if any(id(p) not in live for p in params))
    if swapped:
        raise PipelineError(f"tensor parallelism replaced the tied layer(s) {swapped} of this PipelineModule; tied "
                            "layers cannot be tensor-parallel yet: leave them out of the plan (or untie them)")


def discard_pipeline(model: torch.nn.Module) -> None:
    """`initialize()` failed after `prepare_pipeline`: take the tie hooks off the user's parameters."""
    tied = _TIED.pop(model, None)
    if tied is not None:
        tied.remove_hooks()


def pipeline_split(model: torch.nn.Module) -> tuple[int, int]:
    """(pipe degree, this rank's pipe rank): a PipelineModule's, else (1, 0)."""
    if isinstance(model, PipelineModule):
        return model.num_stages, model.stage_id
    return 1, 0


def pipeline_fingerprint(model: torch.nn.Module) -> list[Any] | None:
    """What every rank of a pipeline must agree on (each holds other layers): the whole plan."""
    if not isinstance(model, PipelineModule):
        return None
    return [model.num_stages, model.stages_per_rank, model.parts, model.layer_classes,
            sorted((k, v) for k, v in model.tied_keys.items())]


class PipelineEngine(PipelineEngineSurface, Engine):
    """Made by `zerodist.initialize()` for a `PipelineModule`."""

    def __init__(self, module: torch.nn.Module, **kwargs: Any):
        if comm.device_for_rank().type != "cpu":
            # [Note: pipeline messages on the CPU] p2p headers and received tensors are CPU tensors (gloo);
            # NCCL would need them on the rank's GPU. Refused by name rather than failing mid-batch.
            raise PipelineError(f"pipeline parallelism runs on the CPU with gloo in this version; this rank computes on "
                                f"{comm.device_for_rank()} (NCCL): train the PipelineModule on gloo, or without a pipeline")
        super().__init__(module, **kwargs)
        assert isinstance(module, PipelineModule)
        self.pipeline_module = module
        settings = self.config.zerodist.pipeline
        if settings.stages_per_rank not in (None, module.stages_per_rank):
            raise ValueError(f"zerodist.pipeline.stages_per_rank is {settings.stages_per_rank} but the "
                             f"PipelineModule was built with stages_per_rank={module.stages_per_rank}; give the "
                             "same number to both (the module needs it to place its layers)")
        self.micro_batches = self.batch.gradient_accumulation_steps
        self.pipe_ranks = self.topology.ranks("pipe")
        self.pipe_rank = self.topology.axis_rank("pipe")
        self.schedule_name = settings.schedule
        self.schedule = build_schedule(settings.schedule, num_ranks=module.num_stages,
                                       num_microbatches=self.micro_batches, stages_per_rank=module.stages_per_rank)
        self.simulated = check_schedule(self.schedule, num_microbatches=self.micro_batches,
                                        num_stages=module.total_stages)  # bubble, for reports
        self.eval_schedule = _forward_only(self.schedule)
        # The wait for a neighbour's message, and the setting a timeout's error names.
        timeout, setting = settings.timeout, "zerodist.pipeline.timeout"
        if timeout is None:
            timeout, setting = self.config.zerodist.timeout, "zerodist.timeout (zerodist.pipeline.timeout unset)"
        if timeout is None:  # the process group's own timeout
            setting = "ZERODIST_TIMEOUT, else 600 s (zerodist.pipeline.timeout and zerodist.timeout unset)"
        self.executor = PipelineExecutor(module, self.pipe_ranks, timeout_s=timeout, timeout_setting=setting)
        self.last_run: RunResult | None = None
        self.tied = _TIED.pop(module, None)
        self._own_data_iter: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None

    def destroy(self) -> None:
        super().destroy()
        if self.tied is not None:
            self.tied.remove_hooks()

    # ------------------------------------------------------------------ what pipeline mode refuses
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def is_first_stage(self) -> bool:
        return self.pipe_rank == 0

    def is_last_stage(self) -> bool:
        return self.pipe_rank == len(self.pipe_ranks) - 1

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Pull `gradient_accumulation_steps` micro-batches `(inputs, labels)` (first and last stage
        only; from the loader of `initialize(training_data=...)` when `data_iter` is None), run the
        schedule, reduce once, step; the batch's mean loss on every rank."""
        inputs, labels = self._pull(data_iter, self.micro_batches)
        self.finish_param_gathers()
        runtime = self.units
        scale = self.optimizer.scaler.scale / self.micro_batches
        with sharded_access.suspended(), runtime.driven():
            runtime.unshard()  # stage 3: each unit once for the batch; no-op otherwise
            runtime.wait_unshard()
            self.last_run = self.executor.run(
                self.schedule[self.pipe_rank], inputs=inputs, labels=labels, loss_scale=scale,
                after_backward=self.zero_state.schedule.end_backward)
            if self.tied is not None and self.tied.active:
                self.tied.reduce()  # the tie sum, before the data-parallel reduction averages it
                self.zero_state.schedule.end_backward()
            runtime.reduce_gradients()
            runtime.reshard()
        loss = self._agreed_loss(self.last_run)
        self.agg_train_loss = loss
        self._micro_losses = [loss]
        self.micro_steps += self.micro_batches - 1
        self._backward_pending = True
        self._boundary_override = True
        try:
            with sharded_access.suspended():
                self._step({})
        finally:
            self._boundary_override = None
        return loss

    def eval_batch(self, data_iter: Iterator[Any] | None = None, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward only over `num_micro_batches` (default gradient_accumulation_steps) micro-batches;
        the mean loss on every rank (and the last stage's outputs with `return_logits`)."""
        count = num_micro_batches or self.micro_batches
        schedule = self.eval_schedule if count == self.micro_batches else _forward_only(build_schedule(
            self.schedule_name, num_ranks=self.pipeline_module.num_stages, num_microbatches=count,
            stages_per_rank=self.pipeline_module.stages_per_rank))
        comm.barrier()  # DeepSpeed's: no rank starts an eval while another still trains
        inputs, labels = self._pull(data_iter, count)
        self.finish_param_gathers()
        self.module.eval()
        try:
            with sharded_access.suspended(), self.units.driven(), torch.no_grad():
                self.units.unshard()
                self.units.wait_unshard()
                result = self.executor.run(schedule[self.pipe_rank], inputs=inputs, labels=labels, train=False,
                                           keep_outputs=return_logits)
                self.units.reshard()
        finally:
            self.module.train()
        loss = self._agreed_loss(result) if compute_loss else None
        if return_logits:
            outputs = [result.outputs[j] for j in sorted(result.outputs)]
            return loss, outputs
        return loss

    def _pull(self, data_iter: Iterator[Any] | None, count: int) -> tuple[list[Any] | None, list[Any] | None]:
        """The first and last stages read the micro-batches (DeepSpeed's way); the others read nothing."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if data_iter is None and (self._own_data_iter is not None or self.training_dataloader is not None):
            # DeepSpeed's train_batch(): the loader initialize() made from training_data, repeated
            if self._own_data_iter is None:
                self._own_data_iter = self._deepspeed_order_iterator()
            data_iter = self._own_data_iter
        if data_iter is None:
            raise ValueError("train_batch(data_iter) / eval_batch(data_iter): the first and last pipeline stages "
                             "need an iterator of (inputs, labels) micro-batches, e.g. "
                             "iter(zerodist.utils.RepeatingLoader(loader))")
        inputs, labels = [], []
        for index in range(count):
            try:
                batch = next(data_iter)
            except StopIteration:
                raise ValueError(f"the data iterator ran out after {index} of {count} micro-batches; wrap the "
                                 "loader in zerodist.utils.RepeatingLoader") from None
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError(f"a pipeline micro-batch is (inputs, labels), got {type(batch).__name__}"
                                 f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}")
            inputs.append(self._cast(batch[0]))
            labels.append(batch[1])
        return inputs, labels

    def _cast(self, value: Any) -> Any:
        if self.policy.needs_master_copy:
            from zerodist.engine.engine import _cast_floating

            return _cast_floating(value, self.policy.param_dtype)
        return value

    def _agreed_loss(self, result: RunResult) -> torch.Tensor:
        """The batch's mean loss: the last stage's mean over micro-batches, averaged over its
        data-parallel group, then broadcast over the pipe (every rank returns the same)."""
        loss = torch.zeros((), dtype=torch.float64)
        if self.is_last_stage():
            loss = torch.stack([result.losses[j].double() for j in sorted(result.losses)]).mean()
            batch_group = self.topology.group(*self.topology.batch_axes)
            if self.topology.num_batch_shards > 1:
                comm.all_reduce(loss, op=comm.ReduceOp.AVG, group=batch_group)
        if len(self.pipe_ranks) > 1:
            comm.broadcast(loss, src=self.pipe_ranks[-1], group=self.topology.group("pipe"))
        # fp32 as before; an fp64 model's loss stays fp64 (its parity with one process is 1e-12)
        return loss if self.policy.param_dtype == torch.float64 else loss.float()


def _forward_only(schedule: list[list[Action]]) -> list[list[Action]]:
    """The forwards and their messages, in the training schedule's order: without the backwards
    each rank still runs its forwards in an order the others' sends satisfy (sends never block)."""
    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return [[a for a in actions if a.kind in keep] for actions in schedule]
