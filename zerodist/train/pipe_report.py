"""The pipeline section of `zerodist train --pp P`'s summary (the run itself is the plain demo's loop,
zerodist/train/loop.py: the same metrics.csv, loss.png, summary.txt, checkpoints and `--resume`).

    bubble: measured idle share of the pipe ranks (the executor's timed F/B/I/W actions of the run's
            last step) beside the schedule simulator's (F = I = W = 1, B = 2) and the formula
            (p-1)/(v m+p-1) (1F1B's for zero-bubble);
    p2p:    point-to-point bytes per step, all ranks, against 2 m x (micro-batch activation bytes)
            over each stage boundary (forward activations and backward gradients; each tensor rank
            passes the replicated hidden states, so the boundaries count pipe boundaries x data x tensor).

`--trace` adds the timeline's measurement of its traced step and OUT/timeline/pipeline.png
(zerodist/train/pipe_picture.py).
"""

from __future__ import annotations

import socket
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.debug.timeline_analysis import Bar, idle_share
from zerodist.engine import Engine
from zerodist.models import Block
from zerodist.train.pipe_picture import pipeline_lines

__all__ = ["header_line", "pipeline_section", "rank_blocks"]


def _shape(engine: Engine) -> tuple[int, int, int]:
    """(pipe ranks p, stages per rank v, micro-batches m)."""
    pipeline = engine.pipeline
    return len(pipeline.pipe_ranks), pipeline.module.stages_per_rank, pipeline.micro_batches


def _formula(schedule: str, p: int, v: int, m: int) -> tuple[str, float]:
    name = "(p-1)/(v m+p-1)" if schedule != "zb" else "for 1F1B (p-1)/(m+p-1)"
    return name, (p - 1) / (v * m + p - 1)


def header_line(engine: Engine, schedule: str) -> str:
    p, v, m = _shape(engine)
    topology = engine.topology
    return (f"pipeline: {p * v} stages on {p} pipe ranks x {topology.size('data')} data x "
            f"{topology.size('expert')} expert x {topology.size('tensor')} tensor, schedule {schedule}, {m} "
            f"micro-batches of {engine.batch.micro_batch_size}; blocks on rank 0's stages {rank_blocks(engine)}")


def rank_blocks(engine: Engine) -> int:
    """The GPT blocks this rank's stages hold (split_model keeps only them; all of them without a
    pipeline), Domino's blocks among them (a `DominoBlock` holds a demo GPT block's children)."""
    from zerodist.models.moe_gpt import DenseBlock, MoEBlock
    from zerodist.tensor_parallel import DominoBlock

    return sum(1 for module in engine.module.modules() if isinstance(module, (Block, MoEBlock, DenseBlock, DominoBlock)))


def pipeline_section(engine: Engine, schedule: str, seq_len: int, d_model: int, sent_bytes: float, steps: int,
                     title: str, observer: Any, out: Any) -> list[str]:
    """Collective (every rank gathers its last step's timed actions and its p2p bytes); rank 0's lines."""
    run = engine.last_run
    bars = [Bar(a.action.kind.value, a.action.stage, a.action.microbatch, a.start, a.end)
            for a in (run.trace if run is not None else []) if a.action.kind.is_compute]
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, (socket.gethostname(), bars, sent_bytes))
    if comm.get_rank() != 0:
        return []
    p, v, m = _shape(engine)
    name, formula = _formula(schedule, p, v, m)
    pipe = [everyone[r] for r in engine.pipeline.pipe_ranks]
    if len({host for host, _, _ in pipe}) == 1 and all(rows for _, rows, _ in pipe):
        measured = (f"{idle_share([rows for _, rows, _ in pipe]):.3f} measured (executor's timed actions of the "
                    f"last step, rank 0's pipe)")
    else:
        measured = "not measured (the pipe ranks are on several hosts: pass --trace for the timeline's measurement)"
    topology = engine.topology
    element = torch.empty((), dtype=engine.policy.param_dtype).element_size()
    activation = engine.batch.micro_batch_size * seq_len * d_model * element
    boundaries = (p * v - 1) * topology.size("data") * topology.size("expert") * topology.size("tensor")
    sent = sum(b for _, _, b in everyone) / max(1, steps)
    expected = boundaries * 2 * m * activation
    lines = [f"pipeline ({p * v} stages on {p} ranks, schedule {schedule}, m = {m} micro-batches):",
             f"  bubble: {measured}; schedule simulator {engine.simulated.idle_share:.3f} (F=I=W=1, B=2); "
             f"formula {name} = {formula:.3f}",
             f"  p2p: {sent:.0f} bytes per step (all ranks) = {sent / expected if expected else 0.0:.2f} x the formula "
             f"2 m x {activation} bytes (micro-batch activation) x {boundaries} stage boundaries = {expected} bytes"]
    if observer.timeline_report is not None:
        report = observer.timeline_report
        lines += pipeline_lines(report, engine.pipeline.pipe_ranks, engine.simulated, formula, name, title,
                                report.merged.parent if report.merged else out)
    return lines
