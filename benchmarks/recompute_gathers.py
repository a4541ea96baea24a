"""ZeRO-3 with activation checkpointing: how often each block is gathered per step, and the step's time,
without checkpointing, with non-reentrant and with reentrant checkpointing (2 gloo ranks, fp32).

    PYTHONPATH=. python benchmarks/recompute_gathers.py [--model bench-25m] [--steps 4] [--rounds 3]

The GPT with each block run through `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=...)`,
as transformers and DeepSpeed's `checkpointing.checkpoint` call a decoder layer; ZeRO-3 with at most
about two blocks gathered at once (the bounded settings of frozen_memory.py), AdamW, the same seed,
weights and batches in every arm. Per arm, rank 0: the units gathered per step (counted at the
runtime's `unshard`, the benchmark's own engine), the median step time over rounds x steps after one
warm-up step, and the last loss (the same in every arm: checkpointing changes no result).

A block's forward inside a backward pass (a recompute) keeps it gathered for the backward that
follows (`UnitRuntime.hold_recomputed`, from the unit post-hook in zerodist/zero/schedule.py);
before that change a reentrant checkpoint freed it after the recompute and gathered it once more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ranks import enter_rank, run_arm

WORLD_SIZE, MICRO_BATCH, SEQ = 2, 4, 128
ARMS = ("none", "non-reentrant", "reentrant")
BOUNDED = {"stage3_max_live_parameters": 7_000_000, "stage3_max_reuse_distance": 0,
           "stage3_prefetch_bucket_size": 3_200_000}


def checkpointed_gpt(model_name: str, how: str) -> Any:
    import torch
    import torch.utils.checkpoint

    from zerodist.models import GPT, gpt_config

    class CheckpointedGPT(GPT):
        def forward(self, idx: Any, targets: Any = None) -> Any:  # type: ignore[override]
            positions = torch.arange(idx.shape[1])
            x = self.emb_dropout(self.tok_emb(idx.long()) + self.pos_emb(positions))
            for block in self.blocks:
                x = block(x) if how == "none" else torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=how == "reentrant")
            logits = self.lm_head(self.ln_f(x))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())

    torch.manual_seed(0)
    return CheckpointedGPT(gpt_config(model_name))


def worker(rank: int, port: int, how: str, model_name: str, steps: int, rounds: int, folder: str) -> None:
    enter_rank(rank, WORLD_SIZE, port, os.path.join(folder, f"{how}-rank{rank}.log"))
    import torch

    import zerodist

    torch.distributed.init_process_group("gloo")
    model = checkpointed_gpt(model_name, how)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3, **BOUNDED}}
    engine = zerodist.initialize(model=model, config=config)[0]
    runtime = engine.zero_state.runtime
    gathered: list[int] = []
    unshard = runtime.unshard

    def counted(units: Any = None, *, kind: int = 0) -> None:
        gathered.extend(u.index for u in (units or []) if u.state.value == "sharded")
        unshard(units, kind=kind)

    runtime.unshard = counted  # the engine's runtime, not a user object

    def step(index: int) -> float:
        ids = torch.randint(0, model.config.vocab_size, (WORLD_SIZE * MICRO_BATCH, SEQ + 1),
                            generator=torch.Generator().manual_seed(index))[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)

    step(0)  # warm-up
    times, loss, counts = [], 0.0, []
    for index in range(1, 1 + rounds * steps):
        before = len(gathered)
        start = time.perf_counter()
        loss = step(index)
        times.append(time.perf_counter() - start)
        counts.append(len(gathered) - before)
    if rank == 0:
        Path(folder, f"{how}.json").write_text(json.dumps(
            {"step_s": statistics.median(times), "gathers": statistics.median(counts), "loss": loss,
             "blocks": len(model.blocks), "peak_live": runtime.peak_live_numel}))
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-25m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="recompute_gathers_") as folder:
        for how in ARMS:
            result = run_arm("recompute_gathers", how, worker, (how, args.model, args.steps, args.rounds, folder),
                             folder=folder, nprocs=WORLD_SIZE, timeout_s=args.timeout)
            if result is None:
                return 1
            results[how] = result
    base = results["none"]
    print(f"{args.model}, {base['blocks']} blocks, ZeRO-3 bounded, {WORLD_SIZE} gloo ranks, fp32, AdamW, "
          f"{MICRO_BATCH}x{SEQ} per rank; rank 0, median of {args.rounds * args.steps} steps after one warm-up")
    print("| checkpointing | units gathered per step | step s | x none | peak gathered elements | last loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    for how, r in results.items():
        print(f"| {how} | {r['gathers']:.0f} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.3f} | "
              f"{r['peak_live']:,} | {r['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
