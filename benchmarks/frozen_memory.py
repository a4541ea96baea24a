"""Memory per rank when most of the model is frozen (partial fine-tuning, a LoRA base model): DDP, zerodist's
ZeRO-3 and, where installed, DeepSpeed's ZeRO-3, each in its own pair of processes (2 gloo ranks, fp32).

    PYTHONPATH=. python benchmarks/frozen_memory.py [--model bench-25m] [--steps 3] [--arms ddp zerodist ...] [--save]

The GPT with every parameter frozen but its last block, final norm and head; AdamW on what trains; the
same seed, weights and batches in every arm. Per rank 0: the parameter bytes held between steps (DDP:
every parameter; zerodist: `model_state_bytes()["params"]`; DeepSpeed: its partitions, `ds_tensor`),
the peak RSS of the steps (VmHWM, reset after the build) and the loss of the last step. With `--save`,
each rank's heap growth while it saves a checkpoint (malloc's bytes in use, sampled; DDP: rank 0's
`torch.save` of the state dict). The
"-bounded" arms gather at most about two blocks at once; the others keep DeepSpeed's defaults, which
keep every unit gathered from its forward to its backward (the whole model at the peak). At stage 3
zerodist shards frozen parameters as it shards trained ones ([Note: frozen parameters at stage 3] in
zerodist/zero/apply.py), as DeepSpeed does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from memory_breakdown import reset_peak_rss, rss_status
from ranks import enter_rank, run_arm

WORLD_SIZE, MICRO_BATCH, SEQ = 2, 4, 128
TRAINED = ("blocks.7.", "ln_f.", "lm_head.")


# "-bounded": at most about two blocks gathered at once (defaults keep every unit gathered from its
# forward to its backward: DeepSpeed's stage3_max_reuse_distance of 1e9)
BOUNDED = {"stage3_max_live_parameters": 7_000_000, "stage3_max_reuse_distance": 0,
           "stage3_prefetch_bucket_size": 3_200_000}


def config(arm: str) -> dict[str, Any]:
    bounded = BOUNDED if arm.endswith("-bounded") else {}
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3, **bounded}}


def build(arm: str, model_name: str) -> tuple[Any, Any, Any, Any]:
    """(model, what runs a step, parameter bytes this rank holds between steps, what saves a checkpoint
    into a folder)."""
    import torch

    from zerodist.models import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config(model_name))
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(TRAINED))
    if arm == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step(ids: Any) -> float:
            loss = wrapped(ids[:, :-1], ids[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)
        def save(folder: str) -> None:  # DDP's way: rank 0 writes the state dict
            if torch.distributed.get_rank() == 0:
                os.makedirs(folder, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
            torch.distributed.barrier()
        return model, step, lambda: sum(p.numel() * p.element_size() for p in model.parameters()), save
    if arm.startswith("zerodist"):
        import zerodist
        engine = zerodist.initialize(model=model, config=config(arm))[0]
        return model, _engine_step(engine), lambda: engine.model_state_bytes()["params"], engine.save_checkpoint
    import deepspeed
    engine = deepspeed.initialize(model=model, config=config(arm),
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    return model, _engine_step(engine), lambda: sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                                                    for p in model.parameters()), engine.save_checkpoint


def _engine_step(engine: Any) -> Any:
    def step(ids: Any) -> float:
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)
    return step


def worker(rank: int, port: int, arm: str, model_name: str, steps: int, folder: str, saving: bool) -> None:
    enter_rank(rank, WORLD_SIZE, port, os.path.join(folder, f"{arm}-rank{rank}.log"))
    try:
        import torch

        torch.distributed.init_process_group("gloo")
        model, step, held, save = build(arm, model_name)
        built = rss_status()["VmRSS"]
        reset_peak_rss()
        loss = 0.0
        for index in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (WORLD_SIZE * MICRO_BATCH, SEQ + 1),
                                generator=torch.Generator().manual_seed(index))[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
            loss = step(ids)
        result = {"held": held(), "built_rss": built, "peak_rss": rss_status()["VmHWM"], "loss": loss,
                  "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
                  "params": sum(p.numel() for p in model.parameters())}
        if saving:  # how much a checkpoint save adds to this rank's heap in use (sampled every 2 ms)
            Path(folder, f"{arm}-rank{rank}-save.json").write_text(json.dumps(
                _heap_growth(lambda: save(os.path.join(folder, f"{arm}-checkpoint")))))
        if rank == 0:
            Path(folder, f"{arm}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _heap_growth(run: Any) -> int:
    """The most malloc'ed bytes in use while `run()` runs, over those in use before it (glibc's
    mallinfo2, sampled every 2 ms on a thread: RSS would not show it, the heap keeps the steps'
    freed memory resident)."""
    import threading
    import time

    from zerodist.debug import heap_in_use

    before = heap_in_use() or 0
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], heap_in_use() or 0)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], heap_in_use() or 0) - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-25m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=["ddp", "zerodist", "zerodist-bounded", "deepspeed",
                                                       "deepspeed-bounded"])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--save", action="store_true",
                        help="also save a checkpoint after the steps and report each rank's RSS growth during it")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms if not a.startswith("deepspeed") or _has_deepspeed()]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="frozen_memory_") as folder:
        for arm in arms:
            result = run_arm("frozen_memory", arm, worker, (arm, args.model, args.steps, folder, args.save),
                             folder=folder, nprocs=WORLD_SIZE, timeout_s=args.timeout)
            if result is None:
                return 1
            results[arm] = result
            if args.save:
                results[arm]["save_growth"] = [json.loads(Path(folder, f"{arm}-rank{r}-save.json").read_text())
                                               for r in range(WORLD_SIZE)]
    base = results[arms[0]]
    print(f"{args.model}: {base['params']:,} parameters, {base['frozen']:,} frozen; {WORLD_SIZE} gloo ranks, fp32, "
          f"AdamW, {args.steps} steps of {MICRO_BATCH}x{SEQ}; rank 0; ratios against {arms[0]}")
    print("| arm | parameters held | x | peak RSS of the steps | x | RSS after build | x | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm, r in results.items():
        print(f"| {arm} | {r['held'] / 2**20:.1f} MiB | {r['held'] / base['held']:.3f} | {r['peak_rss'] / 2**20:.0f} MiB "
              f"| {r['peak_rss'] / base['peak_rss']:.3f} | {r['built_rss'] / 2**20:.0f} MiB | "
              f"{r['built_rss'] / base['built_rss']:.3f} | {r['loss']:.6f} |")
    if args.save:
        print("\nHeap growth while saving a checkpoint (malloc'ed bytes in use, peak during the save over before it), "
              "per rank:")
        print("| arm | " + " | ".join(f"rank {r}" for r in range(WORLD_SIZE)) + " |")
        print("| --- | " + " | ".join("---" for _ in range(WORLD_SIZE)) + " |")
        for arm, r in results.items():
            print(f"| {arm} | " + " | ".join(f"{g / 2**20:.1f} MiB" for g in r["save_growth"]) + " |")
    return 0


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present but unusable here: left out either way
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
