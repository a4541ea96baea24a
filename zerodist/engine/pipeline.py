"""The pipeline's batch runner: `engine.train_batch(data_iter)` runs a schedule over a `PipelineModule`'s stages.

    engine, *_ = zerodist.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=...), config=...)
    loss = engine.train_batch(data_iter)      # gradient_accumulation_steps micro-batches, one step
    loss = engine.eval_batch(data_iter)

The engine is the one `Engine`; `initialize()` gives it this runner when `zerodist.pipe.
apply_pipeline` made a pipeline. DeepSpeed's `PipelineEngine` surface: `forward`, `backward` and
`step` raise `PipelineError` ("Only train_batch() is accessible in pipeline mode."); `train_batch`
returns the batch's mean loss on every rank (the last stage's, averaged over data-parallel ranks
and broadcast over the pipe). `PipelineEngine` stays importable: `isinstance(engine,
PipelineEngine)` is true of an engine that runs a pipeline.

[Note: pipeline under ZeRO] One batch is one `runtime.driven()` block of the unit runtime
([Note: driving the runtime] in zerodist/zero/runtime.py), and the schedule says when to gather,
free and reduce: its UNSHARD, RESHARD and REDUCE_GRAD actions ([Note: sharding actions] in
zerodist/pipe/schedule.py) reach `StageGathers`, which maps a stage to the units holding its
parameters and calls the runtime's verbs. At stage 3 a stage's units are gathered before its first
compute and freed after its last (or as `zerodist.pipeline.max_active_stages` bounds them), so a
rank holds gathered only its stages in flight; every backward accumulates gradients locally (the
reducer defers), and a stage's REDUCE_GRAD reduces the buckets whose parameters belong only to
stages past theirs (interleaved virtual stages: the later chunk's buckets before the rank's last
backward, where its units are buckets of their own, e.g. at stage 3); once every stage of the rank
has passed its REDUCE_GRAD the rest is reduced, once, over the stage's own data-parallel group (the
flat groups hold only this rank's parameters, over groups without the pipe axis). Each bucket is
reduced once either way, so the result is bitwise the same whenever it runs. So
ZeRO 0-3 compose with the pipeline the way torch's FSDP2 does it (reduce-scatter deferred to the
last micro-batch), and the sums are stage 0/1's local accumulation. The optimizer's step agrees
on the gradient norm and overflow over the world, so every stage clips and skips alike. Tied
layers (one module on several stages) have their gradients summed over the tie group right
before that reduction (`TiedGradients`); their units stay gathered until it. In the layout-invariant
mode (`zerodist.deterministic`) `PipelineGradients` keeps each micro-batch's gradients apart and
sums them (and the ties) by the canonical tree before that reduction ([Note: pipeline gradients
by micro-batch] in zerodist/engine/pipeline_invariant.py), and the loss is the canonical average.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.engine.engine import Engine, _cast_floating
from zerodist.engine.runners import data_iterator
from zerodist.pipe.apply import PipelineState
from zerodist.pipe.executor import PipelineError, RunResult
from zerodist.pipe.schedule import Action, Kind
from zerodist.engine.pipeline_invariant import PipelineGradients
from zerodist.zero import UnitRuntime, sharded_access
from zerodist.zero.canonical import MODE
from zerodist.zero.canonical import loss_mean as canonical_loss_mean
from zerodist.zero.units import Unit

__all__ = ["PipelineEngine", "PipelineError", "PipelineRunner"]


class PipelineRunner:
    """Runs a batch through the schedule executor, with the unit runtime driven around it."""

    only_train_batch = True

    def __init__(self, pipeline: PipelineState):
        self.pipeline = pipeline
        self.canonical: PipelineGradients | None = None

    def train_batch(self, engine: Engine, data_iter: Iterator[Any] | None) -> torch.Tensor:
        """Pull `gradient_accumulation_steps` micro-batches `(inputs, labels)` (first and last stage
        only; from the loader of `initialize(training_data=...)` when `data_iter` is None), run the
        schedule, reduce once, step; the batch's mean loss on every rank."""
        pipeline, count = self.pipeline, self.pipeline.micro_batches
        inputs, labels = self._pull(engine, data_iter, count)
        runtime, schedule = engine.units, engine.zero_state.schedule
        runtime.finish_gathers(release=True)  # the schedule gathers what each stage needs, when
        actions, after_backward = pipeline.actions(), schedule.end_backward
        canonical = self._canonical_gradients(engine)  # the layout-invariant mode's hook, else None
        if canonical is not None:
            canonical.begin(actions)
            after_backward = canonical.after_backward(schedule.end_backward)
        gathers = StageGathers(runtime, pipeline, schedule.end_backward,
                               before_reduce=canonical.finish if canonical is not None else None)
        with sharded_access.suspended(), runtime.driven():
            pipeline.last_run = pipeline.executor.run(
                actions, inputs=inputs, labels=labels, loss_scale=engine.optimizer.scaler.scale / count,
                after_backward=after_backward, sharding=gathers)
            gathers.finish()
        loss = self._agreed_loss(engine, pipeline.last_run)
        engine.agg_train_loss = loss
        engine.apply_batch([loss], count)
        return loss

    def _canonical_gradients(self, engine: Engine) -> PipelineGradients | None:
        """The layout-invariant mode: each stage's gradients by micro-batch, summed by the canonical
        tree ([Note: pipeline gradients by micro-batch] in zerodist/engine/pipeline_invariant.py)."""
        if engine.config.zerodist.deterministic != MODE:
            return None
        if self.canonical is None:
            zero = engine.zero_state
            self.canonical = PipelineGradients(zero.groups, zero.reducer, self.pipeline.tied,
                                               self.pipeline.micro_batches)
        return self.canonical

    def eval_batch(self, engine: Engine, data_iter: Iterator[Any] | None, *, return_logits: bool,
                   compute_loss: bool, num_micro_batches: int | None) -> Any:
        """Forward only over `num_micro_batches` (default gradient_accumulation_steps) micro-batches;
        the mean loss on every rank (and the last stage's outputs with `return_logits`)."""
        pipeline = self.pipeline
        count = num_micro_batches or pipeline.micro_batches
        actions = pipeline.actions(count, train=False)
        comm.barrier()  # DeepSpeed's: no rank starts an eval while another still trains
        inputs, labels = self._pull(engine, data_iter, count)
        engine.units.finish_gathers(release=True)
        gathers = StageGathers(engine.units, pipeline, lambda: None)
        engine.module.eval()
        try:
            with sharded_access.suspended(), engine.units.driven(), torch.no_grad():
                result = pipeline.executor.run(actions, inputs=inputs, labels=labels, train=False,
                                               keep_outputs=return_logits, sharding=gathers)
                gathers.finish()
        finally:
            engine.module.train()
        loss = self._agreed_loss(engine, result) if compute_loss else None
        if return_logits:
            return loss, [result.outputs[j] for j in sorted(result.outputs)]
        return loss

    def _pull(self, engine: Engine, data_iter: Iterator[Any] | None,
              count: int) -> tuple[list[Any] | None, list[Any] | None]:
        """The first and last stages read the micro-batches (DeepSpeed's way); the others read nothing.
        Under sequence parallelism each keeps its slice of the whole sequences it reads."""
        if not (self.pipeline.is_first_stage() or self.pipeline.is_last_stage()):
            return None, None
        if data_iter is None and engine.own_data_iter is None and engine.training_dataloader is None:
            raise ValueError("train_batch(data_iter) / eval_batch(data_iter): the first and last pipeline stages "
                             "need an iterator of (inputs, labels) micro-batches, e.g. "
                             "iter(zerodist.utils.RepeatingLoader(loader))")
        source = data_iterator(engine, data_iter, "train_batch()")
        sequence = engine.part_states.get("sequence")  # [Note: sequence x pipe] in zerodist/sequence/apply.py
        inputs, labels = [], []
        for index in range(count):
            try:
                batch = next(source)
            except StopIteration:
                raise ValueError(f"the data iterator ran out after {index} of {count} micro-batches; wrap the "
                                 "loader in zerodist.utils.RepeatingLoader") from None
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError(f"a pipeline micro-batch is (inputs, labels), got {type(batch).__name__}"
                                 f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}")
            local = sequence.local_micro_batch(*batch) if sequence is not None else batch  # its slice of each sequence
            inputs.append(_cast_floating(local[0], engine.policy.param_dtype) if engine.policy.needs_master_copy
                          else local[0])
            labels.append(local[1])
        return inputs, labels

    def _agreed_loss(self, engine: Engine, result: RunResult) -> torch.Tensor:
        """The batch's mean loss: the last stage's mean over micro-batches, averaged over its
        data-parallel group, then broadcast over the pipe (every rank returns the same)."""
        topology, pipe_ranks = engine.topology, self.pipeline.pipe_ranks
        loss = torch.zeros((), dtype=torch.float64)
        if self.pipeline.is_last_stage() and engine.config.zerodist.deterministic == MODE:
            # the K losses by the canonical tree, dealt contiguously ([Note: pipeline gradients by micro-batch])
            losses = [result.losses[j] for j in sorted(result.losses)]
            loss = canonical_loss_mean(losses, topology.group(*topology.batch_axes), accumulation=len(losses),
                                       shard_gradients=False).double()
        elif self.pipeline.is_last_stage():
            loss = torch.stack([result.losses[j].double() for j in sorted(result.losses)]).mean()
            if topology.num_batch_shards > 1:
                comm.all_reduce(loss, op=comm.ReduceOp.AVG, group=topology.group(*topology.batch_axes))
        if len(pipe_ranks) > 1:
            last = self.pipeline.executor.rank_of(self.pipeline.module.total_stages - 1)  # rank 0 in a V
            comm.broadcast(loss, src=pipe_ranks[last], group=topology.group("pipe"))
        # fp32 as before; an fp64 model's loss stays fp64 (its parity with one process is 1e-12)
        return loss if engine.policy.param_dtype == torch.float64 else loss.float()


class StageGathers:
    """The schedule's sharding actions on this rank, done with the unit runtime's verbs ([Note:
    pipeline under ZeRO]). A unit belongs to every stage of this rank whose modules hold one of its
    parameters (the root unit: those outside every other unit); it is gathered while any of them
    is, and freed when none is (a unit with tied parameters: after the tie sum)."""

    def __init__(self, runtime: UnitRuntime, pipeline: PipelineState, end_backward: Callable[[], None],
                 before_reduce: Callable[[], None] | None = None):
        self.runtime, self.pipeline, self.end_backward = runtime, pipeline, end_backward
        self.before_reduce = before_reduce  # the layout-invariant mode's tree (it does the tie sum too)
        runtime.early_gathers = False  # the schedule gathers each stage when it needs it
        module = pipeline.module
        params = {u.index: {id(p) for p in u.module.parameters()} for u in runtime.units[1:]}
        params[runtime.root.index] = {id(p) for p in module.parameters()}.difference(*params.values())
        self.units_of: dict[int, list[Unit]] = {}
        for stage in module.local_stages:
            held = {id(p) for m in module.stage_modules(stage) for p in m.parameters()}
            self.units_of[stage] = [u for u in runtime.units if params[u.index] & held]
        tied = pipeline.tied
        tied_ids = {id(p) for ps in tied.parameters_by_key.values() for p in ps} if tied is not None else set()
        self.pinned = {u.index for u in runtime.units if params[u.index] & tied_ids}
        self.holders: collections.Counter[int] = collections.Counter()  # unit -> stages holding it gathered
        self.to_reduce = set(module.local_stages)
        self.reduced = False
        self.stages_of = self._bucket_stages(runtime, module, tied_ids)

    def __call__(self, action: Action) -> None:
        units = self.units_of.get(action.stage, [])
        if action.kind is Kind.UNSHARD:
            fresh = [u for u in units if not self.holders[u.index]]
            self.holders.update(u.index for u in units)
            self.runtime.unshard(fresh)  # collective over the stage's data-parallel ranks, which run alike
            self.runtime.wait_unshard(units)
        elif action.kind is Kind.RESHARD:
            self.holders.subtract(u.index for u in units)
            self.runtime.reshard([u for u in units if not self.holders[u.index]
                                  and (u.index not in self.pinned or self.reduced)])
        elif action.kind is Kind.REDUCE_GRAD:
            self.to_reduce.discard(action.stage)
            if not self.to_reduce:
                self._reduce()
            elif self.reduce_early and self.before_reduce is None:
                # (the layout-invariant tree rewrites every bucket at the last REDUCE_GRAD: none goes early)
                done = [b for b, stages in self.stages_of if stages and not stages & self.to_reduce]
                if done:  # every data-parallel peer runs this schedule too: the same buckets, in order
                    self.runtime.reducer.reduce_deferred_buckets(done)

    reduce_early = True  # a stage's own buckets at its REDUCE_GRAD (False: all at the rank's last one)

    @staticmethod
    def _bucket_stages(runtime: UnitRuntime, module: Any, tied_ids: set[int]) -> list[tuple[Any, set[int]]]:
        """Each bucket with the local stages whose parameters it holds; empty (reduced last, after
        the tie sum) for a bucket holding a tied parameter."""
        stages_of: dict[int, set[int]] = {}  # a module tied within this rank (a V's embed and head) is in both
        for stage in module.local_stages:
            for m in module.stage_modules(stage):
                for p in m.parameters():
                    stages_of.setdefault(id(p), set()).add(stage)
        result = []
        for group in runtime.reducer.groups:
            for bucket in group.buckets:
                ids = {id(group.params[i]) for i in bucket.span.param_indices}
                stages = (set() if ids & tied_ids or not ids <= stages_of.keys()
                          else set().union(*(stages_of[i] for i in ids)))
                result.append((bucket, stages))
        return result

    def _reduce(self) -> None:
        """Every stage's gradients are complete: the tie sum, then the one reduction of the part."""
        tied = self.pipeline.tied
        if self.before_reduce is not None:
            self.before_reduce()
        elif tied is not None and tied.active:
            tied.reduce()  # the tie sum, before the data-parallel reduction averages it
            self.end_backward()
        self.runtime.reduce_gradients()
        self.reduced = True
        self.runtime.reshard([u for u in self.runtime.units if u.index in self.pinned and not self.holders[u.index]])

    def finish(self) -> None:
        """After the run: what a hook gathered outside the schedule (a root without parameters) is freed."""
        self.runtime.reshard()


class _RunsAPipeline(type(Engine)):  # type: ignore[misc]
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, Engine) and isinstance(instance.runner, PipelineRunner)


class PipelineEngine(Engine, metaclass=_RunsAPipeline):
    """DeepSpeed's name, kept for `isinstance` and imports: an `Engine` whose runner is a pipeline's
    (zerodist.initialize() makes the one `Engine` class for every model)."""
