"""`zerodist train --pp P`: the demo GPT in P pipeline stages, its embedding tied to the head.

The run and its summary (rank 0): the loss every `steps_per_print` steps, then the final loss, the
throughput, the schedule's bubble from the simulator against its formula, and the point-to-point
bytes of one step against 2 m x (micro-batch activation bytes) per stage boundary. Checkpoints,
resuming and MoE are the plain demo's (the CLI refuses them with --pp).
"""

from __future__ import annotations

import math
import time

import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import gpt_config
from zerodist.models.gpt_pipe import gpt_loss, gpt_pipeline_layers
from zerodist.pipe import PipelineModule
from zerodist.train.loop import build_dataset
from zerodist.train.observe import StepObserver
from zerodist.train.options import Progress, TrainOutcome, TrainPlan
from zerodist.train.pipe_picture import pipeline_lines

__all__ = ["train_pipeline"]


def train_pipeline(plan: TrainPlan, progress: Progress | None = None) -> TrainOutcome:
    """Train `plan` with `plan.pipe` stages on this rank; its code is 0 when the last loss is
    finite. Rank 0's header and step losses go to `progress`, its summary into the outcome."""
    show = progress if progress is not None and comm.get_rank() == 0 else None
    torch.manual_seed(plan.seed)
    shape = gpt_config(plan.model)
    per_rank = 2 if plan.pipe_schedule == "interleaved" else 1
    model = PipelineModule(gpt_pipeline_layers(shape), num_stages=plan.pipe, loss_fn=gpt_loss, seed_layers=True,
                           base_seed=plan.seed, partition_method="type:block", stages_per_rank=per_rank)
    dataset = build_dataset(plan, shape.seq_len)
    engine, _, _, _ = zerodist.initialize(model=model, config=plan.config, training_data=dataset)
    rank0 = comm.get_rank() == 0
    p, v, m = plan.pipe, per_rank, engine.batch.gradient_accumulation_steps
    if show is not None:
        show(f"zerodist train: GPT '{plan.model}' in {p * v} pipeline stages on {p} pipe ranks x "
             f"{engine.topology.size('data')} data x {engine.topology.size('tensor')} tensor, ZeRO stage "
             f"{engine.stage}, schedule {plan.pipe_schedule}, {m} micro-batches of "
             f"{engine.batch.micro_batch_size}; layers per stage {model.parts}")
    every = plan.config.get("steps_per_print") or 100
    losses: list[float] = []
    observer = StepObserver(engine.config, plan.out, model, dtype=engine.policy.param_dtype, module_spans=False)
    started = time.perf_counter()
    sent = 0.0
    try:
        for step in range(1, plan.steps + 1):
            step_started = time.perf_counter()
            with comm.trace() as trace, observer.step(step):
                losses.append(observer.run(step, engine.train_batch).item())
            observer.pipeline_step(engine.last_run, time.perf_counter() - step_started, step)
            if step == 1:
                total = torch.tensor([float(trace.total_bytes("send"))])
                comm.all_reduce(total)
                sent = total.item()
            if show is not None and (step % every == 0 or step == plan.steps):
                show(f"step {step}: loss {losses[-1]:.4f}")
        observed = observer.finish({"model": plan.model, "schedule": plan.pipe_schedule})
    finally:
        engine.destroy()
    elapsed = time.perf_counter() - started
    outcome = TrainOutcome(0 if math.isfinite(losses[-1]) else 1)
    if rank0:
        tokens = plan.steps * engine.batch.train_batch_size * shape.seq_len
        element = torch.empty((), dtype=engine.policy.param_dtype).element_size()
        activation = engine.batch.micro_batch_size * shape.seq_len * shape.d_model * element
        boundaries = (p * v - 1) * engine.topology.size("data") * engine.topology.size("tensor")
        formula = (p - 1) / (v * m + p - 1)
        outcome.lines += [
            f"summary: final loss {losses[-1]:.4f}, {plan.steps} steps in {elapsed:.1f} s "
            f"({tokens / elapsed:.0f} tokens/s)",
            f"  bubble: {engine.simulated.idle_share:.3f} of each rank's time (schedule simulator, F=I=W=1, "
            f"B=2); formula {'(p-1)/(v m+p-1)' if plan.pipe_schedule != 'zb' else 'for 1F1B (p-1)/(m+p-1)'} "
            f"= {formula:.3f}",
            f"  p2p: {sent:.0f} bytes per step = {sent / boundaries / (2 * m * activation):.2f} x 2 m x "
            f"{activation} bytes (micro-batch activation) over each of {boundaries} stage boundaries"]
        if observer.timeline_report is not None:
            outcome.lines += pipeline_lines(
                observer.timeline_report, engine.pipeline.pipe_ranks, engine.simulated, formula,
                "(p-1)/(v m+p-1)" if plan.pipe_schedule != "zb" else "for 1F1B (p-1)/(m+p-1)",
                f"GPT {plan.model}, {plan.pipe_schedule}, {p * v} stages on {p} ranks, {m} micro-batches",
                observer.timeline_report.merged.parent if observer.timeline_report.merged else plan.out)
        outcome.lines += observed
    return outcome
