"""`zerodist train --trace` on 2 ranks, at ZeRO-3 and with `--pp 2 --schedule 1f1b`: per-rank
profiler traces and one merged Chrome trace; a span for every collective the tracer counted (the
counts equal, per rank and op) and for every action of the pipeline schedule, in its order; the
picture's idle share within 5 points of the one summed from the spans. Holistic Trace Analysis
loading the same folder is tests/debug/test_timeline_hta.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.harness import run_distributed

pytestmark = pytest.mark.slow  # two 2-rank demo runs, ~30 s each on 2 loaded cores


def _train(out: str, stage: int | None, pp: int | None, schedule: str | None, model: str) -> tuple[int, str]:
    import zerodist.comm as comm
    from zerodist.cli.train import build_plan, train_in_place

    args = argparse.Namespace(model=model, steps=3, config=None, out=out, stage=stage, micro_batch=2, lr=None,
                              bf16=False, fp16=False, seed=None, save_interval=None, resume=False, tp=None,
                              domino=None, moe=None, pp=pp, schedule=schedule, trace="auto")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train_in_place(build_plan(args, comm.get_world_size()))
    return code, printed.getvalue()


def run_traced(out: Path, **kwargs: object) -> str:
    defaults: dict[str, object] = {"stage": None, "pp": None, "schedule": None, "model": "tiny"}
    defaults.update(kwargs)
    results = run_distributed(_train, 2, str(out), defaults["stage"], defaults["pp"], defaults["schedule"],
                              defaults["model"], timeout=180)
    assert [code for code, _ in results] == [0, 0], results
    return results[0][1]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("zero3")
    return out, run_traced(out, stage=3)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("pipe")
    return out, run_traced(out, pp=2, schedule="1f1b")


def _merged(out: Path) -> dict:
    return json.loads((out / "timeline" / "timeline.json").read_text())


def _collectives_per_rank(trace: dict) -> list[Counter]:
    ranks = sorted({e["pid"] for e in trace["traceEvents"]})
    counts = [Counter() for _ in ranks]
    for e in trace["traceEvents"]:
        if e.get("cat") == "collective":
            counts[e["pid"]][e["name"]] += 1
        elif e.get("cat") == "p2p":
            counts[e["pid"]][e["name"]] += 1
    return counts


def _check_files_and_counts(out: Path) -> dict:
    trace = _merged(out)
    assert (out / "timeline" / "traces" / "rank0.json").exists() and (out / "timeline" / "traces" / "rank1.json").exists()
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    tracer = trace["otherData"]["tracer_counts"]
    recorded = _collectives_per_rank(trace)
    for rank in (0, 1):
        assert tracer[rank], "the tracer counted nothing in the traced step"
        assert dict(recorded[rank]) == tracer[rank], f"rank {rank}: timeline {dict(recorded[rank])} vs tracer {tracer[rank]}"
    return trace


def test_zero3_trace_has_every_collective_the_tracer_counted(zero3):
    out, text = zero3
    trace = _check_files_and_counts(out)
    events = trace["traceEvents"]
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= {e["name"] for e in events if e.get("cat") == "collective"}
    for rank in (0, 1):  # compute spans per module, forward and backward, and the step's phases
        names = {e["name"] for e in events if e["pid"] == rank and e.get("cat") in ("compute", "step")}
        assert {"forward blocks.0", "backward blocks.1", "forward", "backward", "step"} <= names
    cats = {(e["pid"], e.get("cat")) for e in events}
    assert {(0, "wait"), (1, "wait"), (0, "zero"), (1, "zero")} <= cats  # watchdog waits, ZeRO-3's unit gathers
    gathers = [e for e in events if e.get("cat") == "collective" and e["name"] == "all_gather"]
    assert all(e["dur"] > 0 and e["args"]["bytes"] > 0 and e["args"]["group_size"] == 2 for e in gathers)
    assert "communication hidden under compute vs exposed" in text and "all_gather" in text
    assert re.search(r"MFU \d+\.\d% of this CPU's measured fp32 matmul peak", text)
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert header.endswith("tflops,mfu,forward_ms,backward_ms,step_ms")


def test_pipeline_trace_has_every_action_of_the_schedule_in_order(pipe):
    from zerodist.pipe.schedule import add_sharding, build_schedule

    out, text = pipe
    trace = _check_files_and_counts(out)
    # --pp 2: 2 micro-batches per stage; the executor also runs (and the timeline shows) its gathers and reductions
    schedule = add_sharding(build_schedule("1f1b", num_ranks=2, num_microbatches=4))
    for rank in (0, 1):
        # a sharding action has no micro-batch (recorded as -1; its str() leaves it out)
        ran = [f"{e['args']['stage']}{e['args']['kind']}{e['args']['microbatch'] if e['args']['microbatch'] >= 0 else ''}"
               for e in
               sorted((e for e in trace["traceEvents"] if e["pid"] == rank and e.get("cat") == "pipe"
                       and "kind" in e.get("args", {})), key=lambda e: e["ts"])]
        assert ran == [str(action) for action in schedule[rank]]
    # the picture's idle share against the one summed from the merged trace's spans
    bars = [e for e in trace["traceEvents"] if e.get("cat") == "pipe" and e.get("args", {}).get("kind") in ("F", "B", "I", "W")]
    makespan = max(e["ts"] + e["dur"] for e in bars) - min(e["ts"] for e in bars)
    summed = 1 - sum(e["dur"] for e in bars) / (2 * makespan)
    drawn = float(re.search(r"idle share drawn: (\d\.\d+) as it ran", text).group(1))
    assert abs(drawn - summed) < 0.05, (drawn, summed)
    assert (out / "timeline" / "pipeline.png").stat().st_size > 10_000
    assert "bubble measured from the timeline (step 2)" in text and "simulator 0.200" in text
