"""What the step timeline costs per training step, off and on.

    python -m zerodist run --nproc 2 benchmarks/timeline_overhead.py --stage 3      # 2 gloo ranks

One engine, the configurations taking turns step by step (the machine is shared, so each keeps
its best round's median step): `off` (no recorder: every hook is one flag test); `recording`
(zerodist.comm.timeline recording, per-module forward/backward spans from hooks); `recording +
torch.profiler` (what `zerodist train --trace` does by default). Prints each median step and its
ratio to `off` on rank 0.

Off cannot be compared with "no hooks at all" in one process, so its cost is bounded instead: the
hooks a step reaches (counted while recording: collectives, waits, gathers, pipeline actions, swap
I/O, module spans) times the measured cost of one off-path hook (`timeline.mark()` plus the flag
test), as a share of the step; recording is bounded the same way with the cost of one record. On a
shared machine those bounds are firmer than the step-time ratios. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import zerodist
import zerodist.comm as comm
from zerodist.comm import timeline
from zerodist.debug.timeline import _ModuleSpans, traced_modules
from zerodist.models import GPT, gpt_config


def one_step(engine, tokens: torch.Tensor, mode: str) -> tuple[float, int]:
    """One step in `mode`; returns its seconds and, while recording, the hook calls it reached."""
    spans = _ModuleSpans(traced_modules(engine.module)) if mode != "off" else None
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
        if mode == "recording + torch.profiler" else None
    if profiler is not None:
        profiler.__enter__()
    recorder = timeline.start(comm.get_rank()) if mode != "off" else None
    start = time.perf_counter()
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    seconds = time.perf_counter() - start
    hooks = 0
    if recorder is not None:
        timeline.stop()
        hooks = len(recorder.collectives) * 2 + len(recorder.spans)
    if spans is not None:
        spans.remove()
    if profiler is not None:
        profiler.__exit__(None, None, None)
    return seconds, hooks


def off_hook_seconds() -> float:
    """One off-path hook: `mark()` (a flag test) and `finish()` with it (another), as the hooks call them."""
    number = 200_000
    return min(timeit.repeat(lambda: timeline.finish(timeline.mark(), "x", "y"), number=number, repeat=5)) / number


def on_record_seconds() -> float:
    """One record while recording: a span's context (two clock reads, one object), as the hooks make them."""
    number = 50_000
    timeline.start()
    try:
        def record() -> None:
            with timeline.span("compute", "x"):
                pass
        return min(timeit.repeat(record, number=number, repeat=5)) / number
    finally:
        timeline.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--model", default="bench")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    torch.manual_seed(0)
    engine = zerodist.initialize(model=GPT(gpt_config(args.model)), config=config)[0]
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, 256, (args.micro_batch, gpt_config(args.model).seq_len + 1), generator=g)
    modes = ["off", "recording", "recording + torch.profiler"]
    best: dict[str, float] = {}
    hooks = 0
    for round_ in range(args.rounds + 1):
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.steps):  # the modes take turns step by step, so a change in load hits all alike
            for mode in modes:
                seconds, counted = one_step(engine, tokens, mode)
                times[mode].append(seconds)
                hooks = max(hooks, counted)
        if round_:  # round 0 warms up every configuration
            for mode in modes:
                best[mode] = min(best.get(mode, float("inf")), statistics.median(times[mode]))
    per_hook = off_hook_seconds()
    if comm.get_rank() == 0:
        print(f"GPT {args.model!r} ({sum(p.numel() for p in engine.module.parameters()):,} parameters), ZeRO stage "
              f"{args.stage}, {comm.get_world_size()} rank(s), micro-batch {args.micro_batch}, 1 thread; median "
              f"step, best of {args.rounds} rounds of {args.steps} steps:")
        for mode, seconds in best.items():
            print(f"  {mode:<28} {seconds * 1e3:8.2f} ms   {seconds / best['off']:.3f}x")
        bound = hooks * per_hook
        print(f"  off, bounded: {hooks} hook calls per step x {per_hook * 1e9:.0f} ns = {bound * 1e6:.1f} us "
              f"= {bound / best['off']:.4%} of the step")
        on = hooks * on_record_seconds()
        print(f"  recording, bounded: {hooks} records per step x {on / max(hooks, 1) * 1e9:.0f} ns = {on * 1e6:.1f} us "
              f"= {on / best['off']:.4%} of the step (the step-time ratios above are within this machine's noise)")
    engine.destroy()


if __name__ == "__main__":
    main()
