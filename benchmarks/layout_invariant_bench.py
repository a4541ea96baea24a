"""What the layout-invariant mode (`zerodist.deterministic: "layout_invariant"`) costs per step
against the default arithmetic, on the 25.5M benchmark GPT (docs/determinism.md).

    python -m zerodist run --nproc 2 benchmarks/layout_invariant_bench.py --stage 0

Both engines live in the same processes and run interleaved rounds (the machine is shared: each
keeps its best round's median step). Each step is `train_batch()` over `--accumulation`
micro-batches. Also prints, from the tracer, the bus bytes of one step by op (gradients and
everything else) for both, and the mode's largest extra gradient memory seen per rank (the
counters' partial sums; the all-to-all's receive buffer, one bucket per bucket in flight, is
transient and not counted here). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import GPT, gpt_config

MODES = {"default": "off", "layout_invariant": "layout_invariant"}


def build(mode: str, stage: int, micro_batch: int, accumulation: int):
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zerodist": {"deterministic": mode}, "steps_per_print": 10**9}
    torch.manual_seed(0)
    return zerodist.initialize(model=GPT(gpt_config("bench-25m")), config=config)[0]


def batches(tokens: torch.Tensor, accumulation: int):
    return iter([(tokens[:, :-1], tokens[:, 1:])] * accumulation)


def extra_numel(engine) -> int:
    """Elements the counters hold beyond the buffers the default mode has too (grad_owned, the full buffer)."""
    total = 0
    for group in engine.zero_state.groups:
        for bucket in group.buckets:
            own = {t.data_ptr() for t in (bucket.grad_owned, bucket.grad_full) if t is not None}
            held = [*bucket.tree.levels, *bucket.tree.spares] if bucket.tree else []
            total += sum(t.numel() for t in held if t is not None and t.data_ptr() not in own)
    return total


def step_times(engine, tokens: torch.Tensor, steps: int, accumulation: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(batches(tokens, accumulation))
        times.append(time.perf_counter() - start)
    return times


def bus_bytes(engine, tokens: torch.Tensor, accumulation: int) -> dict[str, float]:
    with comm.trace() as trace:
        engine.train_batch(batches(tokens, accumulation))
    return {op: s.bus_bytes for op, s in trace.summary().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {name: build(mode, args.stage, args.micro_batch, args.accumulation) for name, mode in MODES.items()}
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g)
    best: dict[str, float] = {}
    for round_ in range(args.rounds + 1):
        for name, engine in engines.items():
            median = statistics.median(step_times(engine, tokens, args.steps, args.accumulation))
            if round_:  # round 0 warms up both
                best[name] = min(best.get(name, float("inf")), median)
    traffic = {name: bus_bytes(engine, tokens, args.accumulation) for name, engine in engines.items()}
    # the largest extra the counters hold: before the boundary micro-step (stages 0/1), or at it (2/3)
    mode = engines["layout_invariant"]
    peak = 0
    for _ in range(args.accumulation - 1):
        mode.backward(mode(tokens[:, :-1], tokens[:, 1:]))
        mode.step()
        peak = max(peak, extra_numel(mode))
    mode.backward(mode(tokens[:, :-1], tokens[:, 1:]))
    peak = max(peak, extra_numel(mode))
    mode.step()
    if comm.get_rank() == 0:
        params = sum(p.numel() for p in mode.module.parameters())
        print(f"benchmark GPT bench-25m ({params:,} parameters), ZeRO stage {args.stage}, {comm.get_world_size()} "
              f"rank(s), accumulation {args.accumulation}, micro-batch {args.micro_batch} x {args.seq} tokens, "
              f"1 thread; median step, best of {args.rounds} interleaved rounds of {args.steps} steps:")
        for name, seconds in best.items():
            print(f"  {name:<17} {seconds * 1e3:9.1f} ms   {seconds / best['default']:.3f}x")
        for name, ops in traffic.items():
            shown = ", ".join(f"{op} {value / 2**20:.3f} MiB" for op, value in sorted(ops.items()))
            print(f"  bus bytes per step, {name}: {sum(ops.values()) / 2**20:.3f} MiB ({shown})")
        print(f"  extra gradient memory per rank (counters' partial sums, peak): {peak * 4 / 2**20:.1f} MiB "
              f"({peak:,} fp32 elements)")


if __name__ == "__main__":
    main()
