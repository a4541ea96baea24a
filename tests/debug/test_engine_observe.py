"""DeepSpeed's `wall_clock_breakdown` and `flops_profiler`, and zerodist's `zerodist.timeline`, in a
loop of the user's own (`engine(batch); engine.backward(loss); engine.step()`), on 2 ranks: the
logged phase times are there and consistent (forward + backward + step within the step's wall
time), the profile's FLOPs are what `zerodist.debug.flops.count_flops` counts for the same
micro-batches of the demo GPT, and the timeline is the merged Chrome trace `zerodist train --trace`
writes. No timed assertion: only sums and orderings of one run's own measurements."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.slow  # one 2-rank run of 4 steps with the profiler and the timeline: ~15 s on 2 loaded cores

STEPS, GAS, MICRO = 4, 2, 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _batch(step: int, micro: int, rank: int, seq_len: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randint(0, vocab, (MICRO, seq_len), generator=g)


def _user_loop(out: str, stage: int) -> dict:
    import zerodist
    import zerodist.comm as comm
    from zerodist.debug.flops import count_flops
    from zerodist.models import GPT, gpt_config

    config = gpt_config("tiny")
    torch.manual_seed(0)
    model = GPT(config)
    reference = GPT(config)  # the same shapes, counted in one process
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
        "steps_per_print": 2, "wall_clock_breakdown": True, "csv_monitor": {"enabled": True, "output_path": f"{out}/csv"},
        "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 2, "top_modules": 1,
                           "output_file": f"{out}/flops.txt"},
        "zerodist": {"timeline": {"enabled": True, "start_step": 3, "output_dir": f"{out}/timeline",
                                  "torch_profiler": False}},
    }
    handler = _Lines()
    logging.getLogger("zerodist").addHandler(handler)
    try:
        engine, _, _, _ = zerodist.initialize(model=model, config=ds_config)
        for step in range(1, STEPS + 1):
            for micro in range(GAS):
                tokens = _batch(step, micro, comm.get_rank(), config.seq_len, config.vocab_size)
                loss = engine(tokens, tokens)
                engine.backward(loss)
                engine.step()
        timing = engine.phase_timing
        flops = timing.flops.total if timing.flops is not None else None
        last = dict(timing.last)
        engine.destroy()
    finally:
        logging.getLogger("zerodist").removeHandler(handler)

    def reference_step() -> None:
        for micro in range(GAS):
            tokens = _batch(2, micro, comm.get_rank(), config.seq_len, config.vocab_size)
            reference(tokens, tokens).backward()

    expected, _ = count_flops(reference_step, reference)
    return {"lines": handler.lines, "flops": flops, "expected": expected.total, "last": last}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("engine_observe")
    return out, run_distributed(_user_loop, 2, str(out), 3, timeout=120)


_BREAKDOWN = re.compile(r"step (\d+): time \(ms\) \| (.*) \(mean per optimizer step over the last (\d+)\)")


def test_wall_clock_breakdown_logs_phase_times_within_the_step_wall_time(ranks):
    _, results = ranks
    logged = [m for line in results[0]["lines"] if (m := _BREAKDOWN.search(line))]
    assert [(int(m[1]), int(m[3])) for m in logged] == [(2, 2), (4, 2)]  # every steps_per_print steps
    for m in logged:
        times = {k: float(v) for k, v in (part.split(": ") for part in m[2].split(" | "))}
        assert list(times) == ["fwd", "bwd", "bwd_allreduce", "step", "wall"]
        assert all(v >= 0 for v in times.values()) and times["fwd"] > 0 and times["bwd"] > 0
        assert times["fwd"] + times["bwd"] + times["step"] <= times["wall"] + 0.003  # printed to 3 decimals
        assert times["bwd_allreduce"] <= times["bwd"]
    assert not any(_BREAKDOWN.search(line) for line in results[1]["lines"])  # rank 0 logs
    for result in results:  # the unrounded numbers, on every rank
        last = result["last"]
        assert last["fwd"] + last["bwd"] + last["step"] <= last["wall"]


def test_wall_clock_breakdown_writes_deepspeeds_elapsed_time_events_to_the_monitors(ranks):
    out, _ = ranks
    folder = out / "csv" / "DeepSpeedJobName"
    rows = {}
    for event in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        lines = (folder / f"Train_Samples_elapsed_time_ms_{event}.csv").read_text().splitlines()
        assert lines[0] == f"step,Train/Samples/elapsed_time_ms_{event}"
        rows[event] = [(int(step), float(ms)) for step, ms in (line.split(",") for line in lines[1:])]
        assert [step for step, _ in rows[event]] == [8, 16, 24, 32]  # samples seen, every step
    for (_, bwd), (_, inner), (_, allreduce) in zip(rows["backward"], rows["backward_inner"],
                                                    rows["backward_allreduce"]):
        assert inner + allreduce == pytest.approx(bwd) and 0 <= allreduce <= bwd


def test_flops_profile_counts_what_count_flops_counts_for_the_same_micro_batches(ranks):
    out, results = ranks
    for result in results:
        assert result["flops"] == result["expected"] > 0
    report = (out / "flops.txt").read_text()
    assert f"fwd+bwd flops per rank:        {results[0]['expected']:,}" in report
    assert "profile of step 2" in report and "per module" in report and "blocks" in report
    assert "fwd ms" in report
    assert any("written to" in line and "flops.txt" in line for line in results[0]["lines"])


def test_timeline_section_writes_the_merged_trace_from_the_users_loop(ranks):
    out, _ = ranks
    trace = json.loads((out / "timeline" / "timeline.json").read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank and e.get("cat") == "step"]
        assert names.count("forward") == GAS and names.count("backward") == GAS and names.count("step") == GAS
        assert any(e["pid"] == rank and e.get("cat") == "collective" for e in events)
    assert trace["otherData"]["steps"] == [3]
    assert not (out / "timeline" / "traces").exists()  # torch_profiler: false


def _pipeline_loop(out: str) -> dict:
    import zerodist
    from tests.pipe.test_pipeline_engine import GAS as PIPE_GAS, config, micro_batch, mlp_layers
    from zerodist.pipe import PipelineModule

    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    settings = {**config(0), "wall_clock_breakdown": True, "steps_per_print": 1,
                "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{out}/pipe_flops.txt"}}
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    for step in range(2):
        engine.train_batch(iter([micro_batch(step, micro, 0, torch.float32) for micro in range(PIPE_GAS)]))
    result = {"last": dict(engine.phase_timing.last), "flops": engine.phase_timing.flops.total}
    engine.destroy()
    return result


def test_a_pipelines_breakdown_comes_from_its_executors_actions(tmp_path):
    results = run_distributed(_pipeline_loop, 2, str(tmp_path), timeout=120)
    for result in results:  # train_batch: fwd and bwd are the schedule's F and B actions on this rank
        last = result["last"]
        assert set(last) == {"fwd", "bwd", "step", "wall"} and last["fwd"] > 0 and last["bwd"] > 0
        assert last["fwd"] + last["bwd"] + last["step"] <= last["wall"]
    # each stage's 4 linear layers (8 x 8, 4 rows, 4 micro-batches): 512 FLOPs forward, and backward's
    # input and weight gradients, but for the input of stage 0's first layer, which needs none
    micro = 2 * 4 * 8 * 8
    assert [r["flops"] for r in results] == [4 * (4 * micro + 7 * micro), 4 * (4 * micro + 8 * micro)]
    assert (tmp_path / "pipe_flops.txt").exists()


def _counted_outside(out: str) -> tuple:
    import zerodist
    from zerodist.debug.flops import count_flops
    from zerodist.models import GPT, gpt_config

    config = gpt_config("tiny")
    model, reference = GPT(config), GPT(config)
    settings = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "steps_per_print": 10**9, "flops_profiler": {"enabled": True, "output_file": f"{out}/flops.txt"}}
    engine, _, _, _ = zerodist.initialize(model=model, config=settings)
    tokens = _batch(1, 0, 0, config.seq_len, config.vocab_size)

    def step() -> None:
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()

    outside, _ = count_flops(step, model)  # as zerodist train counts its profile step
    own = engine.phase_timing.flops
    engine.destroy()
    expected, _ = count_flops(lambda: reference(tokens, tokens).backward(), reference)
    return outside.total, expected.total, own


def test_a_count_already_under_way_makes_the_engines_profile_stand_down(tmp_path):
    [(outside, expected, own)] = run_distributed(_counted_outside, 1, str(tmp_path), timeout=60)
    assert outside == expected  # counted once, not twice under two counters
    assert own is None and not (tmp_path / "flops.txt").exists()
