"""`zerodist train --pp P --trace`: the pipeline's schedule as it ran beside the simulator's plan.

Rank 0 takes the traced step's F/B/I/W spans from the timeline, draws them (one row per pipe rank
of the first data-parallel replica) above the simulator's plan of the same schedule into
OUT/timeline/pipeline.png, and states the measured idle share beside the formula's and the
simulator's ([Note: measured overlap] and `idle_share` in zerodist/debug/timeline_analysis.py).
"""

from __future__ import annotations

from pathlib import Path
from zerodist.debug.timeline import TimelineReport
from zerodist.debug.timeline_analysis import Bar, idle_share, pipeline_rows, step_window
from zerodist.pipe.schedule_checks import SimulationResult

__all__ = ["plan_rows", "pipeline_lines"]


def plan_rows(simulated: SimulationResult) -> list[list[Bar]]:
    """The simulator's compute actions as bars (its time units)."""
    return [[Bar(t.action.kind.value, t.action.stage, t.action.microbatch, t.start, t.end)
             for t in rank if t.action.kind.is_compute] for rank in simulated.timeline]


def pipeline_lines(report: TimelineReport, pipe_ranks: list[int], simulated: SimulationResult, formula: float,
                   formula_name: str, title: str, out: Path) -> list[str]:
    """Rank 0: the measured bubble line and the picture (OUT/pipeline.png); `pipe_ranks`: the global
    ranks of the first pipe, in pipe order."""
    by_rank = {r.rank: r for r in report.recorders}
    recorders = [by_rank[r] for r in pipe_ranks if r in by_rank]
    offsets = [report.offsets_ns[r] for r in pipe_ranks if r in by_rank]
    first = report.steps[0] if report.steps else None
    window = step_window(recorders, offsets, first) if first is not None else None
    rows = pipeline_rows(recorders, offsets, window)
    measured = idle_share(rows)
    lines = [f"  bubble measured from the timeline (step {first}): {measured:.3f} idle of the pipe ranks' time; "
             f"simulator {simulated.idle_share:.3f}; formula {formula_name} = {formula:.3f}"]
    path = out / "pipeline.png"
    try:
        from zerodist.debug.timeline_draw import draw_pipeline

        drawn = draw_pipeline([(f"as it ran (step {first}, ms)", rows, "ms"),
                               ("the simulator's plan (F = I = W = 1, B = 2)", plan_rows(simulated), "time units")],
                              path, title)
    except ImportError:
        return lines + ["  pipeline picture not written: matplotlib is not installed (pip install matplotlib)"]
    lines.append(f"  wrote {path} (idle share drawn: {drawn[0]:.3f} as it ran, {drawn[1]:.3f} planned)")
    return lines

