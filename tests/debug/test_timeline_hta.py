"""Holistic Trace Analysis (PyPI `HolisticTraceAnalysis`, the `test` extra) loads the per-rank traces
`zerodist train --trace` writes as one multi-rank trace, and finds in every rank's parsed trace a
span of each collective the communication tracer counted (no mock: HTA's own parser).

On a CPU run HTA's kernel-based analyses have nothing to work on: they read GPU kernels (events with
a CUDA stream), and a gloo run has none. `get_temporal_breakdown` and `get_idle_time_breakdown`
raise, `get_comm_comp_overlap` gives NaN per rank, `get_cuda_kernel_launch_stats` empty frames,
`get_queue_length_summary` / `get_memory_bw_summary` None; this test pins that, so a change in
HTA (or in what the traces hold) is seen. The trace loading, the per-rank frames and the CPU
operators (our `zerodist::*` ranges, `ProfilerStep#N`) work on any device.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.debug.test_timeline_runs import run_traced

hta = pytest.importorskip("hta.trace_analysis", reason="pip install HolisticTraceAnalysis (the test extra)")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("hta")
    run_traced(out, stage=3)
    return out / "timeline"


def test_hta_loads_every_rank_and_finds_each_collective(traced):
    analysis = hta.TraceAnalysis(trace_dir=str(traced / "traces"))
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    symbols = analysis.t.symbol_table.get_sym_table()
    counted = json.loads((traced / "timeline.json").read_text())["otherData"]["tracer_counts"]
    for rank in (0, 1):
        frame = analysis.t.get_trace(rank)
        names = frame["name"].map(lambda index: symbols[index])
        found = names[names.str.startswith("zerodist::")].value_counts().to_dict()
        for op, count in counted[rank].items():
            assert found.get(f"zerodist::{op}") == count, (rank, op, found)
        assert (names == "ProfilerStep#2").sum() == 1  # HTA's iteration marker: the traced step
        assert {"zerodist::forward", "zerodist::backward", "zerodist::step"} <= set(found)


def test_kernel_analyses_give_nothing_on_a_cpu_run(traced):
    analysis = hta.TraceAnalysis(trace_dir=str(traced / "traces"))
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert all(math.isnan(v) for v in overlap["comp_comm_overlap_pctg"])
    with pytest.raises((IndexError, ValueError)):
        analysis.get_temporal_breakdown(visualize=False)
    with pytest.raises(ValueError):
        analysis.get_idle_time_breakdown(visualize=False)
    assert all(frame.empty for frame in analysis.get_cuda_kernel_launch_stats(visualize=False).values())
