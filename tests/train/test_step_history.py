"""The demo keeps a bounded number of step records however long it trains ([Note: bounded step
history] in zerodist/train/metrics.py): the records were most of the 0.5 KiB/step RSS creep of a
2000-step run (issue 37). Counted exactly, as live objects, never as RSS (that is
benchmarks/rss_slope.py's)."""

from __future__ import annotations

import csv
import gc
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_distributed
from zerodist.train.metrics import StepHistory, StepRecord

STEPS = 14  # past the window: a list of every record would hold 13 at the last row


def _live_records() -> int:
    # collected first: a run earlier in this warm worker may leave its records in garbage not yet
    # collected (a cycle through a frame), which is not what this run keeps
    gc.collect()
    return sum(isinstance(o, StepRecord) for o in gc.get_objects())


def _train_counting_records(out: str) -> dict[str, Any]:
    """One rank of a stage-3 demo run; the live StepRecords counted at each step's row."""
    import zerodist.train.loop as loop
    from zerodist.train import Overrides, TrainPlan, merge_config

    counts: list[int] = []
    measure = loop.rss_bytes

    def counting_rss() -> int:  # called once a step, as the step's record is made
        counts.append(_live_records())
        return measure()

    config = merge_config(None, Overrides(stage=3, micro_batch=2), STEPS)
    plan = TrainPlan(model="tiny", steps=STEPS, seed=0, out=Path(out), config=config, corpus_bytes=200_000)
    loop.rss_bytes = counting_rss
    try:
        outcome = loop.train(plan)
    finally:
        loop.rss_bytes = measure
    summary = outcome.summary
    return {"code": outcome.code, "counts": counts, "steps": summary.steps, "first": summary.first_loss,
            "last": summary.last_losses}


@pytest.mark.slow  # the demo's start-up on 2 ranks (its FLOP peak, counter, summary): tens of s on 2 cores
@pytest.mark.multiprocess
def test_a_run_keeps_at_most_a_window_of_step_records(tmp_path: Path) -> None:
    results = run_distributed(_train_counting_records, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["code"] == 0
        assert len(result["counts"]) == STEPS
        # before step k's record: min(k - 1, WINDOW) kept (the list of every record held k - 1)
        assert result["counts"] == [min(k, StepHistory.WINDOW) for k in range(STEPS)], rank
        assert result["steps"] == STEPS
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == STEPS  # every row, written as the steps went
    first, last = results[0]["first"], results[0]["last"]
    assert first == pytest.approx(losses[0], abs=1e-6)
    assert last == pytest.approx(losses[-StepHistory.WINDOW:], abs=1e-6)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # plotted from metrics.csv


@pytest.mark.unit
def test_step_history_keeps_the_count_the_first_loss_and_a_window() -> None:
    history = StepHistory()
    for step in range(1, 101):
        history.append(StepRecord(step, float(step), 1e-3, 1.0, 0))
    assert len(history) == 100
    assert history.first_loss == 1.0
    assert len(history.recent) == StepHistory.WINDOW
    assert history.recent_losses() == [float(s) for s in range(91, 101)]
