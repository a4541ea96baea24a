"""Memory: the estimate against the engine (model states exact, totals within 15% of measured
heap growth), memory_report, memory_breakdown's logging, and the leak watch."""

from __future__ import annotations

import contextlib
import gc
import io
import time

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.cli.main import main
from zerodist.debug.estimate import formula
from zerodist.debug import LeakWatch, estimate_for_engine, heap_in_use, memory_report, padded_num_params
from zerodist.models import GPT, gpt_config, make_mlp
from zerodist.utils import format_bytes
from tests.debug_helpers import captured_logs
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

SEQ = 128  # the benchmark GPT's sequence length


def _bench_engine(stage: int, *, micro_batch: int, bf16: bool = False, bucket: int = 500_000_000):
    config = {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
              "steps_per_print": 10**9, "bf16": {"enabled": bf16}}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(gpt_config("bench"))
    return zerodist.initialize(model=model, config=config)[0]


def _bench_steps(engine, steps: int, seq: int = SEQ, sample=None) -> None:
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, 256, (engine.batch.micro_batch_size, seq + 1), generator=g)
    for _ in range(steps):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        if sample is not None:
            sample()


# ---------------------------------------------------------------- the estimate against the engine

@pytest.mark.parametrize("bf16", [False, True])
@distributed_test(world_size=2)
def test_estimate_equals_measured_model_states_exactly(bf16):
    for stage in (0, 1, 2):
        engine = _bench_engine(stage, micro_batch=1, bf16=bf16, bucket=100_000)  # 10 buckets
        try:
            _bench_steps(engine, 1, seq=8)  # Adam's states exist after the first step
            measured = engine.model_state_bytes()
            estimate = estimate_for_engine(engine)
            assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
                measured["params"], measured["grads"], measured["optimizer"]), stage
            assert estimate.model_states == measured["total"]
            # the CLI, given the engine's padded count, prints the same number
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(["estimate", "--params", str(padded_num_params(engine)), "--world-size", "2",
                      "--stage", str(stage), "--dtype", "bf16" if bf16 else "fp32"])
            assert f"= {format_bytes(measured['total'])}" in out.getvalue()
            assert "(exact)" in memory_report(engine).format()
        finally:
            engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_estimate_counts_the_padding_of_every_bucket(stage):
    """The toy MLP's sizes force padding (1,987 parameters in buckets of ~500): Ψ is the padded count."""
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(
        stage, bf16={"enabled": True}, zero_optimization={"reduce_bucket_size": 500, "allgather_bucket_size": 500}))
    try:
        x, y = global_batch(0, 4)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        assert padded_num_params(engine) > sum(p.numel() for p in engine.module.parameters()) == 1987
        assert estimate_for_engine(engine).model_states == engine.model_state_bytes()["total"]
    finally:
        engine.destroy()


@distributed_test(world_size=2)
def test_estimate_counts_the_frozen_shards_at_stage_3():
    """The MLP with its first layer frozen at ZeRO-3: the frozen shards are in model_state_bytes and
    in the estimate (Φ/N of their elements' bytes, nothing more), which agree exactly."""
    model = make_mlp()
    model[0].requires_grad_(False)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(
        3, zero_optimization={"stage3_param_persistence_threshold": 0}))
    try:
        x, y = global_batch(0, 4)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        estimate = estimate_for_engine(engine)
        frozen = sum(p.numel() for p in model[0].parameters())
        assert frozen <= estimate.frozen < frozen + 2 * 64 * 2  # padded to N x 64 per bucket
        assert estimate.model_states == engine.model_state_bytes()["total"]
        assert "4Φ/N" in formula(3, "fp32", frozen=True)
    finally:
        engine.destroy()


def _settled_heap_in_use() -> int:
    """malloc's bytes in use once nothing more is being freed. One full-suite run measured stage 1's
    growth 3.5 MB short: one full parameter buffer, freed inside the window. gloo's worker thread
    lets go of a finished collective's tensors (likely the warm-up engine's last parameter gather)
    a moment after wait() returns ([Note: buffer pool])."""
    deadline = time.monotonic() + 2
    last = heap_in_use()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = heap_in_use()
        if now == last:
            return now
        last = now
    return last


def _peak_heap_growth(stage: int, micro_batch: int):
    """(measured, estimate): the peak of malloc's bytes in use, sampled after every module's forward,
    at every gradient in backward and after each step, above what was in use before the model."""
    warm = _bench_engine(stage, micro_batch=micro_batch)  # first-use allocations (kernels, imports)
    _bench_steps(warm, 1)
    warm.destroy()
    del warm
    gc.collect()  # nothing of an earlier engine may be freed inside the window
    base = _settled_heap_in_use()
    peak = [base]

    def sample(*_):
        peak[0] = max(peak[0], heap_in_use())

    engine = _bench_engine(stage, micro_batch=micro_batch)
    hooks = [m.register_forward_hook(sample) for m in engine.module.modules()]
    engine.reducer.grad_observers.append(sample)
    try:
        _bench_steps(engine, 3, sample=sample)
        estimate = estimate_for_engine(engine, hidden=128, layers=4, seq_len=SEQ, micro_batch=micro_batch, heads=4,
                                       flash_attention=True)
    finally:
        for hook in hooks:
            hook.remove()
        engine.destroy()
    return peak[0] - base, estimate


@distributed_test(world_size=2)
def test_estimated_total_within_15_percent_of_measured_heap_growth():
    results = []
    for stage in (0, 1, 2):
        measured, estimate = _peak_heap_growth(stage, micro_batch=8)
        gc.collect()
        assert abs(estimate.total - measured) <= 0.15 * measured, (stage, estimate, measured)
        results.append((stage, measured, estimate.total, estimate.model_states, estimate.buckets,
                        estimate.activations))
    return results


# ---------------------------------------------------------------- reports and the breakdown log

@distributed_test(world_size=2)
def test_memory_report_per_rank_and_breakdown_logged_every_steps_per_print():
    config = base_config(1, steps_per_print=2, memory_breakdown=True)
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config)
    try:
        with captured_logs() as logs:
            for step in range(4):
                x, y = global_batch(step, 4)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
        reports = memory_report(engine, all_ranks=True)
        assert [r.rank for r in reports] == [0, 1]
        assert all(r.rss > 0 and r.peak_rss >= r.rss and r.model_states == engine.model_state_bytes() for r in reports)
        assert reports[0].estimate.model_states == engine.model_state_bytes()["total"]
        breakdown = [m for m in logs if "memory:" in m]
        if comm.get_rank() == 0:
            assert [m.split(":")[0] for m in breakdown] == ["step 2", "step 4"]
            assert "ZeRO formula 8Ψ + 8Ψ/N" in breakdown[0] and "(exact)" in breakdown[0]
        else:
            assert breakdown == []  # rank 0's report; every rank runs the leak watch
        return breakdown
    finally:
        engine.destroy()


# ---------------------------------------------------------------- the leak watch

@pytest.mark.unit
def test_leak_watch_warns_on_steady_growth_naming_the_window():
    watch = LeakWatch(window=5, min_growth_bytes=1000, measure=lambda: 0, what="heap in use")
    values = [100, 100, 90, 100, 95, 100, 100]  # noise: no warning
    assert all(watch.observe(step, v) is None for step, v in enumerate(values, start=1))
    warnings = {step: watch.observe(step, 100 + 600 * (step - 7)) for step in range(8, 16)}  # +600 B a step
    fired = {step: w for step, w in warnings.items() if w}
    assert list(fired) == [10, 14]  # one warning per window: the watch starts a new window after each
    assert "grew at 3 of 4 steps over the window of steps 6-10: 100 B -> 1.86 KiB" in fired[10]
    assert "grew at 4 of 4 steps over the window of steps 10-14" in fired[14] and "heap in use" in fired[14]
    tiny_rises = LeakWatch(window=5, min_growth_bytes=1000, measure=lambda: 0)
    jump_and_creep = [0, 8, 16, 5000, 5008]  # one jump plus tiny rises at every step: not steady
    assert all(tiny_rises.observe(s, v) is None for s, v in enumerate(jump_and_creep))


@pytest.mark.unit
def test_leak_watch_ignores_one_jump_and_growth_that_falls_back():
    watch = LeakWatch(window=5, min_growth_bytes=1000, measure=lambda: 0)
    jump = [0, 0, 0, 5000, 5000, 5000, 5000, 5000]  # one allocation that stays (a cache): not a leak
    assert all(watch.observe(s, v) is None for s, v in enumerate(jump))
    watch = LeakWatch(window=5, min_growth_bytes=1000, measure=lambda: 0)
    saw = [0, 800, 1600, 0, 800, 1600, 2400, 100]  # grows, then is freed
    assert all(watch.observe(s, v) is None for s, v in enumerate(saw))
    with pytest.raises(ValueError, match="at least 3"):
        LeakWatch(window=2)


@distributed_test(world_size=2)
def test_engine_warns_of_a_steady_leak_on_one_rank():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(2, memory_breakdown=True))
    kept = []
    try:
        with captured_logs() as logs:
            for step in range(12):
                x, y = global_batch(step, 4)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
                if comm.get_rank() == 1 and step >= 1:  # steps 2.. keep 256 KiB each: the leak
                    kept.append(torch.ones(64 * 1024))
        leaks = [m for m in logs if "memory leak" in m]
        if comm.get_rank() == 1:
            assert len(leaks) == 1, logs
            # the first full window (steps 1-10) already grew at every step but the first
            assert leaks[0].startswith("memory leak on rank 1? heap in use grew at ")
            assert "of 9 steps over the window of steps 1-10: " in leaks[0]
        else:
            assert leaks == []  # no false alarm on the rank that does not leak
        return leaks
    finally:
        engine.destroy()
