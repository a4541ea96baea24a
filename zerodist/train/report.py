"""The end-of-run summary: measured numbers set beside the formulas of docs/design/zero.md.

Model state per rank for Ψ parameters on N ranks with Adam (two fp32 states):

    stage   fp32          mixed precision (2-byte params and grads)
    0       16Ψ           16Ψ
    1       8Ψ + 8Ψ/N     4Ψ + 12Ψ/N
    2       4Ψ + 12Ψ/N    2Ψ + 14Ψ/N
    3       16Ψ/N         16Ψ/N

Ψ is the padded element count (`sum(g.layout.total_numel for g in engine.groups)`): every
bucket is padded to split evenly, so Ψ/N is a whole number and the formula is exact.

Communication per optimizer step, in bus elements (what one rank sends, nccl-tests' factors):
a reduce-scatter moves Ψ(N-1)/N, an all-reduce 2Ψ(N-1)/N, an all-gather Ψ(N-1)/N. Stages 0-2
with reduce-scatter move 2Ψ(N-1)/N (reduce, then gather gradients at stage 0 or parameters at
stages 1/2); stage 2 reduces every micro-step, so accumulation adds Ψ(N-1)/N per extra micro-step.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from zerodist.utils import format_bytes
from zerodist.zero.policy import ShardingPolicy

# (constant, per-rank) multiples of Ψ bytes, by (stage, mixed precision).
_STATE_TERMS = {
    (0, False): (16, 0), (1, False): (8, 8), (2, False): (4, 12), (3, False): (0, 16),
    (0, True): (16, 0), (1, True): (4, 12), (2, True): (2, 14), (3, True): (0, 16),
}


def state_formula(stage: int, mixed_precision: bool) -> str:
    constant, sharded = _STATE_TERMS[(stage, mixed_precision)]
    terms = ([f"{constant}Ψ"] if constant else []) + ([f"{sharded}Ψ/N"] if sharded else [])
    return " + ".join(terms)


def state_formula_bytes(stage: int, mixed_precision: bool, psi: int, world_size: int) -> int:
    constant, sharded = _STATE_TERMS[(stage, mixed_precision)]
    return int(constant * psi + Fraction(sharded * psi, world_size))


def expected_bus_bytes(*, stage: int, psi: int, world_size: int, accumulation_steps: int, reduce_scatter: bool,
                       element_bytes: int) -> int:
    """Bytes one rank sends per optimizer step for gradients and parameters (module docstring)."""
    policy = ShardingPolicy.from_stage(stage)
    syncs = accumulation_steps if policy.shard_gradients else 1
    per_sync = 1 if reduce_scatter else 2
    gathers = 1 if policy.shard_optimizer_state or reduce_scatter else 0
    return int(Fraction(psi * (world_size - 1), world_size) * (syncs * per_sync + gathers) * element_bytes)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One rank's model-state bytes (from `engine.model_state_bytes()`) and peak RSS."""

    rank: int
    state: dict[str, int]
    peak_rss: int
    expected: int | None = None  # this rank's own formula bytes (a pipeline: each stage holds its own Ψ)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    steps: int
    world_size: int
    stage: int
    precision: str
    elapsed_s: float
    first_loss: float  # this run's first step's
    last_losses: list[float]  # its last ten steps' (the run keeps no more: [Note: bounded step history])
    tokens_per_s: float
    psi: int
    psi_by_stage: dict[int, int]  # padded elements by the stage their group runs (stage 3: sharded vs persistent)
    memory: list[RankMemory]
    comm_table: str  # the tracer's format_summary() on rank 0
    comm_bytes: int  # every collective on rank 0 while training
    comm_bus_bytes: float
    logging_bytes: int  # of which: the loss averaging for the progress bar
    logging_bus_bytes: float
    expected_bus_bytes_per_step: int
    # (stage, padded elements, ranks) of groups sharded over fewer ranks than the batch shards:
    # MoE experts, sharded over ("data",) only (see docs/moe.md)
    narrow_groups: tuple[tuple[int, int, int], ...] = ()
    tensor_degree: int = 1  # world_size counts batch shards (the N of the formulas); ranks = N x tensor
    sequence_degree: int = 1  # > 1: world_size is data x sequence, the ranks dense parameters are sharded over
    pipe_degree: int = 1  # > 1: Ψ is rank 0's stages'; each rank is set beside its own stages' formula


def loss_line(first: float, tail: list[float]) -> str:
    """The summary's loss line from the first loss and the last steps' (at most ten are shown)."""
    tail = tail[-10:]
    last = tail[-1]
    fell = 100.0 * (1.0 - last / first) if first else 0.0
    return (f"loss {first:.3f} -> {last:.3f} (mean of the last {len(tail)} steps {sum(tail) / len(tail):.3f}; "
            f"fell {fell:.0f}%)")


def expected_state_bytes(psi_by_stage: dict[int, int], narrow: list[tuple[int, int, int]] | tuple[
        tuple[int, int, int], ...], mixed: bool, world_size: int) -> int:
    """The formula's model-state bytes of one rank: its groups by stage over N, plus the narrow ones over theirs."""
    return (sum(state_formula_bytes(stage, mixed, psi, world_size) for stage, psi in psi_by_stage.items())
            + sum(state_formula_bytes(stage, mixed, psi, ranks) for stage, psi, ranks in narrow))


def memory_lines(summary: RunSummary) -> list[str]:
    mixed = summary.precision != "fp32"
    expected = sum(state_formula_bytes(stage, mixed, psi, summary.world_size)
                   for stage, psi in summary.psi_by_stage.items())
    dense_psi = summary.psi - sum(psi for _, psi, _ in summary.narrow_groups)
    if len(summary.psi_by_stage) == 1:
        described = f"Ψ = {dense_psi:,} padded parameters, N = {summary.world_size}, Adam; " \
                    f"docs/design/zero.md: {state_formula(summary.stage, mixed)}"
    else:  # stage 3 with parameters under the persistence threshold: those are stage-2 groups
        parts = [f"stage {stage}: {psi:,} ({state_formula(stage, mixed)})"
                 for stage, psi in sorted(summary.psi_by_stage.items(), reverse=True)]
        described = f"Ψ = {dense_psi:,} padded parameters, of which {'; '.join(parts)}, N = {summary.world_size}, " \
                    "Adam; docs/design/zero.md"
    if summary.narrow_groups:
        expected += sum(state_formula_bytes(stage, mixed, psi, ranks) for stage, psi, ranks in summary.narrow_groups)
        experts = sum(psi for _, psi, _ in summary.narrow_groups)
        ranks = sorted({r for _, _, r in summary.narrow_groups})
        described += f"; plus MoE experts' Ψ = {experts:,} sharded over N = {', '.join(map(str, ranks))}"
    if summary.pipe_degree > 1:
        described = f"rank 0's stages: {described}; each rank against its own stages' Ψ"
    lines = [f"model state per rank ({described} = {format_bytes(expected)}):"]
    for m in summary.memory:
        total, own = m.state["total"], m.expected if m.expected is not None else expected
        verdict = ("matches" if total == own else f"differs by {format_bytes(total - own)}") + (
            f" its stages' formula {format_bytes(own)}" if own != expected else "")
        lines.append(f"  rank {m.rank}: params {format_bytes(m.state['params'])} + grads {format_bytes(m.state['grads'])}"
                     f" + optimizer {format_bytes(m.state['optimizer'])} = {format_bytes(total)} ({verdict}); "
                     f"peak RSS {format_bytes(m.peak_rss)}")
    return lines


def comm_lines(summary: RunSummary) -> list[str]:
    steps = max(1, summary.steps)
    training_bytes = (summary.comm_bytes - summary.logging_bytes) / steps
    training_bus = (summary.comm_bus_bytes - summary.logging_bus_bytes) / steps
    lines = [f"communication on rank 0 over {summary.steps} steps (tracer):"]
    lines += ["  " + line for line in summary.comm_table.splitlines()]
    expected = format_bytes(summary.expected_bus_bytes_per_step)
    lines.append(f"  per step: {format_bytes(training_bytes)} issued, {format_bytes(training_bus)} bus bytes for "
                 f"training; docs/design/zero.md expects {expected} bus bytes for "
                 "gradients and parameters (plus a few bytes of norm/overflow all_reduce)"
                 + ("; the rest is tensor-parallel traffic (below)" if summary.tensor_degree > 1 else "")
                 + ("; the pipeline's sends are its p2p (below)" if summary.pipe_degree > 1 else "")
                 + ("; the rest is sequence-parallel traffic (below) and the loss's token counts"
                    if summary.sequence_degree > 1 else ""))
    lines.append(f"  loss averaging for the progress bar adds {format_bytes(summary.logging_bytes / steps)} per step "
                 "(included in the table)")
    return lines


def _ranks(summary: RunSummary) -> str:
    if summary.tensor_degree == 1 and summary.pipe_degree == 1:
        return f"{summary.world_size} rank(s)"
    # world_size counts the ranks dense parameters shard over: data x sequence
    data = summary.world_size // summary.sequence_degree
    sequence = f" x sequence {summary.sequence_degree}" if summary.sequence_degree > 1 else ""
    if summary.pipe_degree == 1:
        return (f"{summary.world_size * summary.tensor_degree} ranks (data {data}{sequence} x tensor "
                f"{summary.tensor_degree}; Ψ below is each rank's tensor-local count)")
    return (f"{summary.world_size * summary.tensor_degree * summary.pipe_degree} ranks (pipe {summary.pipe_degree} x "
            f"data {data}{sequence} x tensor {summary.tensor_degree}; Ψ below is rank 0's stages' "
            f"{'tensor-local ' if summary.tensor_degree > 1 else ''}count)")


def format_summary(summary: RunSummary) -> str:
    lines = [
        f"summary: {summary.steps} steps on {_ranks(summary)}, ZeRO stage {summary.stage}, "
        f"{summary.precision}, {summary.elapsed_s:.1f} s",
        "  " + loss_line(summary.first_loss, summary.last_losses),
        f"  throughput {summary.tokens_per_s:,.0f} tokens/s (all ranks)",
    ]
    lines += ["  " + line for line in memory_lines(summary) + comm_lines(summary)]
    return "\n".join(lines)
