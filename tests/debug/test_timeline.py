"""The step timeline's pure parts: interval arithmetic, overlap per kind, the Chrome trace, the
pipeline's idle share (measured, drawn, planned), the recorder when off, FLOP counting."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from zerodist.comm import timeline
from zerodist.comm.timeline import CollectiveSpan, Recorder, Span
from zerodist.debug.timeline_analysis import (Bar, chrome_trace, compute_intervals, covered, idle_share,
                                              overlap_by_kind, pipeline_rows, subtract, union)

pytestmark = pytest.mark.unit


def test_interval_arithmetic():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert subtract([(0, 10), (20, 30)], [(2, 3), (8, 22), (25, 26)]) == [(0, 2), (3, 8), (22, 25), (26, 30)]
    assert subtract([(0, 10)], []) == [(0, 10)]
    assert covered((5, 25), [(0, 10), (20, 30)]) == 10


def _recorder(rank: int = 0, wall: int = 0) -> Recorder:
    recorder = Recorder(rank=rank, wall_offset_ns=wall, start_ns=0)
    # compute 0-100 with a blocked wait 60-80 inside it; a gather in flight 10-80 (waited 60-80),
    # a synchronous all-reduce 100-120 outside any compute
    recorder.spans.append(Span("compute", "forward", 0, 100))
    gather = CollectiveSpan("all_gather", 64, "world", 2, 0, 10, 12, [(60, 80)], 80, True)
    reduce = CollectiveSpan("all_reduce", 8, "world", 2, 1, 100, 120, [(100, 120)], 120, False)
    recorder.collectives += [gather, reduce]
    return recorder


def test_overlap_is_the_flight_under_compute_minus_the_waits():
    recorder = _recorder()
    assert compute_intervals(recorder) == [(0, 60), (80, 100)]
    kinds = overlap_by_kind([recorder, _recorder(rank=1)])
    gather, reduce = kinds["all_gather"], kinds["all_reduce"]
    assert (gather.count, gather.num_bytes, gather.in_flight_ns, gather.hidden_ns) == (2, 128, 140, 100)
    assert gather.exposed_ns == 40 and gather.blocked_ns == 40
    assert (reduce.in_flight_ns, reduce.hidden_ns, reduce.exposed_ns) == (40, 0, 40)


def test_chrome_trace_has_a_process_per_rank_and_a_thread_per_comm_group():
    trace = chrome_trace([_recorder(0, wall=1000), _recorder(1, wall=5000)], [0, 4000])
    events = trace["traceEvents"]
    json.dumps(trace)  # plain JSON
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "main"), (0, "comm world"), (1, "comm world")} <= threads
    gathers = [e for e in events if e.get("cat") == "collective" and e["name"] == "all_gather"]
    assert [g["pid"] for g in gathers] == [0, 1]
    # rank 1's wall clock runs 4000 ns ahead of rank 0's: both land at the same aligned time
    assert gathers[0]["ts"] == gathers[1]["ts"] and gathers[0]["dur"] == pytest.approx(0.07)
    assert all(e["ph"] in ("M", "X", "i") for e in events)


def test_idle_share_of_measured_bars_matches_the_simulator_arithmetic():
    from zerodist.pipe.schedule import build_schedule
    from zerodist.pipe.schedule_checks import simulate
    from zerodist.train.pipe_picture import plan_rows

    result = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8))
    assert idle_share(plan_rows(result)) == pytest.approx(result.idle_share)
    assert idle_share(plan_rows(result)) == pytest.approx(3 / 11)


def test_pipeline_rows_come_from_pipe_spans_on_the_aligned_clock():
    first, second = Recorder(0, 0, 0), Recorder(1, 500, 0)
    first.spans += [Span("pipe", "F0", 0, 10, args={"kind": "F", "stage": 0, "microbatch": 0}),
                    Span("pipe", "SEND_F0", 10, 11, args={"kind": "SEND_F", "stage": 0, "microbatch": 0})]
    second.spans += [Span("pipe", "F0", -480, -470, args={"kind": "F", "stage": 1, "microbatch": 0})]
    rows = pipeline_rows([first, second], [0, 0])
    assert rows == [[Bar("F", 0, 0, 0.0, 1e-8)], [Bar("F", 1, 0, 2e-8, 3e-8)]]
    assert idle_share(rows) == pytest.approx(1 - 20 / 60)


def test_the_drawn_idle_share_is_the_bars_idle_share(tmp_path):
    pytest.importorskip("matplotlib")
    from zerodist.debug.timeline_draw import draw_pipeline

    rows = [[Bar("F", 0, 0, 0.0, 1.0), Bar("B", 0, 0, 3.0, 5.0)], [Bar("F", 1, 0, 1.0, 2.0), Bar("W", 1, 0, 2.0, 3.0)]]
    shares = draw_pipeline([("run", rows, "ms")], tmp_path / "p.png")
    assert shares == [pytest.approx(idle_share(rows))] and (tmp_path / "p.png").stat().st_size > 1000


def test_pipe_draw_cli_draws_the_plan(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from zerodist.cli import pipe

    code = pipe.run(argparse.Namespace(schedule="zb", stages=4, micro_batches=8, stages_per_rank=None,
                                       out=str(tmp_path / "zb.png")))
    assert code == 0 and (tmp_path / "zb.png").exists()
    assert "idle 0.111" in capsys.readouterr().out
    assert pipe.run(argparse.Namespace(schedule="1f1b", stages=4, micro_batches=0, stages_per_rank=None,
                                       out=str(tmp_path / "x.png"))) == 2


def test_recording_off_records_nothing_and_costs_one_flag_test():
    assert not timeline.recording and timeline.current() is None
    assert timeline.span("compute", "x") is timeline.span("step", "y")  # one shared no-op
    assert timeline.mark() == 0
    launch = lambda async_op: None  # noqa: E731
    assert timeline.collective("all_reduce", None, 0, None, launch) is launch
    recorder = timeline.start(3)
    try:
        with timeline.span("compute", "forward", module="m"):
            pass
        began = timeline.mark()
        timeline.finish(began, "swap", "swap read", "swap", bytes=4)
        with pytest.raises(RuntimeError, match="already recording"):
            timeline.start()
    finally:
        assert timeline.stop() is recorder
    assert [(s.cat, s.name, s.track) for s in recorder.spans] == [("compute", "forward", "main"),
                                                                   ("swap", "swap read", "swap")]
    assert recorder.spans[1].args == {"bytes": 4} and not timeline.recording


def test_flops_of_the_25m_demo_gpt_are_6_n_tokens_within_10_percent():
    from zerodist.debug.flops import count_flops, format_flops_table
    from zerodist.models import GPT, count_parameters, gpt_config

    config = gpt_config("bench-25m")
    with torch.device("meta"):  # shapes only: the counter needs no values
        model = GPT(config)
        tokens = torch.zeros(2, config.seq_len, dtype=torch.long)

    def step():
        loss = model(tokens, tokens)
        (loss if loss.dim() == 0 else loss[0]).backward()

    count, _ = count_flops(step, model)
    n = count_parameters(model)
    assert n == pytest.approx(25.5e6, rel=0.01)
    assert count.total == pytest.approx(6 * n * tokens.numel(), rel=0.10)
    assert count.forward[""] * 3 == count.total  # backward = 2 x forward for matrix products
    assert count.forward["blocks.0"] == count.forward["blocks.7"]
    table = format_flops_table(count, depth=2, top=1)
    assert "blocks" in table[2] and "99.5%" in table[2] and len(table) == 4


def test_device_peak_on_cpu_is_measured():
    from zerodist.debug.flops import GPU_PEAK_FLOPS, device_peak

    peak, source = device_peak(torch.device("cpu"), torch.float32)
    assert peak is not None and peak > 1e8 and "measured" in source
    assert GPU_PEAK_FLOPS["h100"]["bf16"] == pytest.approx(989.4e12)


def test_config_sections_load_and_trace_flag_sets_the_window():
    from zerodist.cli.train import _enable_trace
    from zerodist.config import Config

    config = Config.load({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"enabled": False, "profile_step": 2},
                          "zerodist": {"timeline": {"enabled": True, "start_step": 3, "num_steps": 2}}})
    assert config.flops_profiler.profile_step == 2 and config.zerodist.timeline.num_steps == 2
    raw: dict = {}
    _enable_trace(raw, "auto", 1)
    assert raw["zerodist"]["timeline"] == {"enabled": True, "start_step": 1}
    _enable_trace(raw, "2:3", 4)
    assert raw["zerodist"]["timeline"]["num_steps"] == 3
    with pytest.raises(ValueError, match="past the run's last step 3"):
        _enable_trace({}, "2:3", 3)
    with pytest.raises(ValueError, match="--trace 2 or --trace 2:3"):
        _enable_trace({}, "x", 3)


def test_swap_reads_and_writes_are_spans_on_the_swap_track(tmp_path):
    from zerodist.offload.swap_files import SwapDirectory

    swap = SwapDirectory(tmp_path, "run", 0)
    data = torch.arange(16, dtype=torch.float32)
    swap.write(0, data)  # not recording: nothing
    recorder = timeline.start()
    try:
        swap.write(1, data)
        back = torch.empty(16)
        swap.read(1, back)
    finally:
        timeline.stop()
        swap.close()
    assert torch.equal(back, data)
    assert [(s.cat, s.name, s.track, s.args) for s in recorder.spans] == [
        ("swap", "swap write", "swap", {"bytes": 64}), ("swap", "swap read", "swap", {"bytes": 64})]


def test_a_failed_step_stops_the_recording(tmp_path, monkeypatch):
    from zerodist.debug import timeline as debug_timeline

    monkeypatch.setattr(debug_timeline, "align_clocks", lambda: [0])
    monkeypatch.setattr(debug_timeline.comm, "get_rank", lambda: 0)
    session = debug_timeline.StepTimeline(tmp_path, start_step=1, num_steps=2, torch_profiler=False)
    with session.step(0):
        assert not timeline.recording  # outside the window
    with pytest.raises(ZeroDivisionError):
        with session.step(1):
            assert timeline.recording
            1 / 0
    assert not timeline.recording and timeline.current() is None
