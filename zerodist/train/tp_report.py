"""The tensor-parallel lines of `zerodist train`'s summary: bytes per step against the formula,
and Domino's schedule-level overlap.

The data-parallel and tensor-parallel groups can have the same size (2 x 2), so the tracer's
records cannot tell their collectives apart; the tensor-parallel layers count their own bytes in
the schedule log (`zerodist.tensor_parallel.schedule_log`) that wraps the training steps. Per
micro-batch of T = micro x seq tokens, hidden h, vocabulary V, L
blocks, e bytes per element (docs/tensor_parallel.md, "Communication and overlap"):

    forward:  2L all-reduces of T*h (Domino: 2kL of T*h/k) + 1 all-reduce T*h (vocab-parallel
              embedding) + 1 all-gather T*V (the gathered LM head)
    backward: 2L all-reduces of T*h (Domino: 2kL of T*h/k) + 1 all-reduce T*h (LM head input)

With a sequence axis T is the rank's slice (micro x seq / P); with `--moe` the experts are
replicated over the tensor axis, so a block has one all-reduce (its attention's), L instead of 2L.

Sequence parallelism replaces the all-reduces with all-gathers and reduce-scatters; the formula
is then not shown.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from zerodist.tensor_parallel import ScheduleLog
from zerodist.utils import format_bytes

if TYPE_CHECKING:
    from zerodist.engine import Engine
    from zerodist.models.gpt import GPTConfig


@dataclasses.dataclass(frozen=True)
class TensorParallelReport:
    degree: int
    domino_chunks: int | None
    forward_bytes: int
    backward_bytes: int
    expected_forward_bytes: int | None
    expected_backward_bytes: int | None
    forward_overlap: float | None  # Domino only: fraction of forward bytes whose window holds compute
    backward_overlap: float | None


def gpt_formula(*, tokens: int, hidden: int, vocab: int, layers: int, element_bytes: int, first: bool = True,
                last: bool = True, mlp_layers: int | None = None) -> tuple[int, int]:
    """(forward, backward) payload bytes of one micro-batch (module docstring). Under a pipeline a
    rank counts its own stages' `layers`, the embedding's all-reduce only on the `first` stage and
    the head's all-gather and all-reduce only on the `last`. `mlp_layers`: the blocks whose MLP is
    tensor-parallel (default all; the MoE demo's experts are replicated over the tensor axis: 0)."""
    blocks = layers + (layers if mlp_layers is None else mlp_layers)  # one row-parallel all-reduce each
    forward = (blocks + first) * tokens * hidden * element_bytes + last * tokens * vocab * element_bytes
    return forward, (blocks + last) * tokens * hidden * element_bytes


def measure_from_log(engine: Engine, gpt: GPTConfig, log: ScheduleLog, micro_steps: int, *,
                     moe: bool = False) -> TensorParallelReport:
    """Per micro-batch bytes and overlap from the schedule log of a training run of the demo GPT
    shaped `gpt` (rank 0's stages under a pipeline; `moe`: the MoE demo, every block's MLP an MoE
    layer whose experts the tensor axis replicates). Under sequence parallelism a micro-batch's
    tensor-parallel collectives carry the rank's slice of each sequence."""
    settings = engine.config.zerodist.tensor_parallel
    chunks = settings.domino.chunks if settings.domino is not None else None
    layers, first, last = gpt.n_layers, True, True
    if engine.pipeline is not None:
        from zerodist.train.pipe_report import rank_blocks

        layers, first, last = rank_blocks(engine), engine.is_first_stage(), engine.is_last_stage()
    expected: tuple[int | None, int | None] = (None, None)
    if not settings.sequence_parallel:
        tokens = engine.batch.micro_batch_size * gpt.seq_len // engine.topology.size("sequence")
        expected = gpt_formula(tokens=tokens, hidden=gpt.d_model, vocab=gpt.vocab_size, layers=layers,
                               element_bytes=engine.policy.param_dtype.itemsize, first=first, last=last,
                               mlp_layers=0 if moe else None)
    overlap = (log.overlap_fraction("forward"), log.overlap_fraction("backward")) if chunks else (None, None)
    steps = max(1, micro_steps)
    return TensorParallelReport(engine.topology.size("tensor"), chunks, log.all_bytes("forward") // steps,
                                log.all_bytes("backward") // steps, *expected, *overlap)


def report_lines(report: TensorParallelReport) -> list[str]:
    def verdict(measured: int, expected: int | None) -> str:
        if expected is None:
            return "(sequence parallel: no formula shown)"
        return f"formula {format_bytes(expected)}: " + ("matches" if measured == expected else "differs")

    lines = [f"tensor parallel (degree {report.degree}), per micro-batch on rank 0 (schedule log):",
             f"  forward {format_bytes(report.forward_bytes)} ({verdict(report.forward_bytes, report.expected_forward_bytes)}),"
             f" backward {format_bytes(report.backward_bytes)} "
             f"({verdict(report.backward_bytes, report.expected_backward_bytes)})"]
    if report.domino_chunks:
        assert report.forward_overlap is not None and report.backward_overlap is not None  # measured with Domino
        lines.append(f"  Domino {report.domino_chunks} chunks: {100 * report.forward_overlap:.0f}% of forward and "
                     f"{100 * report.backward_overlap:.0f}% of backward tensor-parallel bytes are issued before compute "
                     "that runs until their wait (schedule order; time-level overlap: benchmarks/)")
    return lines
