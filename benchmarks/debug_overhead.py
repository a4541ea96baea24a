"""What the debugging toolkit costs per training step on the benchmark GPT.

    python -m zerodist run --nproc 2 benchmarks/debug_overhead.py      # 2 gloo ranks
    python benchmarks/debug_overhead.py                                # one process

Configurations, interleaved round after round on the same process (the machine is shared, so
each configuration keeps its best round): off; `nan_check` (forward + gradient checks and one
scalar all_reduce per micro-step); `memory_breakdown` (a leak-watch sample per step);
`GradSyncWatch` (one fp32 copy of each local gradient; the check itself is not run).
Prints the median step time of each and its ratio to off, on rank 0. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zerodist
import zerodist.comm as comm
from zerodist.debug import GradSyncWatch
from zerodist.models import GPT, gpt_config

CONFIGS = {
    "off": {},
    "nan_check": {"zerodist": {"debug": {"nan_check": True}}},
    "memory_breakdown": {"memory_breakdown": True},
    "GradSyncWatch": {},
}


def build(name: str, stage: int, micro_batch: int):
    config = {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, **CONFIGS[name]}
    torch.manual_seed(0)
    engine = zerodist.initialize(model=GPT(gpt_config("bench")), config=config)[0]
    watch = GradSyncWatch(engine) if name == "GradSyncWatch" else None
    return engine, watch


def step_times(engine, tokens: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {name: build(name, args.stage, args.micro_batch) for name in CONFIGS}
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, 256, (args.micro_batch, 129), generator=g)
    best: dict[str, float] = {}
    for round_ in range(args.rounds + 1):
        for name, (engine, _) in engines.items():
            median = statistics.median(step_times(engine, tokens, args.steps))
            if round_:  # round 0 warms up every configuration
                best[name] = min(best.get(name, float("inf")), median)
    if comm.get_rank() == 0:
        print(f"benchmark GPT ({sum(p.numel() for p in engines['off'][0].module.parameters()):,} parameters), "
              f"ZeRO stage {args.stage}, {comm.get_world_size()} rank(s), micro-batch {args.micro_batch} x 128 "
              f"tokens, 1 thread; median step, best of {args.rounds} rounds of {args.steps} steps:")
        for name, seconds in best.items():
            print(f"  {name:<17} {seconds * 1e3:8.1f} ms   {seconds / best['off']:.3f}x")


if __name__ == "__main__":
    main()
