"""Checkpoint benchmark: zerodist save/load of the 25M-parameter GPT beside torch.save/torch.load.

    python benchmarks/checkpoint_bench.py                  # 1 and 2 ranks, ZeRO stage 2, 3 repeats
    python benchmarks/checkpoint_bench.py --ranks 2 --stage 1 --repeats 5 --dir /scratch/ckpt

Per world size, the "bench-25m" GPT takes one AdamW step (fp32) so that every rank holds its
shard of the weights and of both Adam moments. Then, each timed between barriers (the slowest
rank counts), median over the repeats:

- zerodist `save_checkpoint`: temporary files, CRC-32, fsync, rename, manifest, `latest`;
- `torch.save` of the very tensors zerodist writes (each rank: its shards, one file per rank),
  without and with flush + fsync (zerodist always fsyncs: a checkpoint is only durable then);
- zerodist `load_checkpoint` into a fresh engine (every file's checksum verified first);
- `torch.load` of the torch.save files, and the same followed by copying into the engine's tensors.

Every timed operation starts after `os.sync()`, so no earlier write is still being flushed; loads
read through a warm page cache (dropping it needs root). Writes
benchmarks/results/checkpoint-<date>.json and .md. A benchmark, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"


def _engine(stage: int) -> Any:
    import zerodist
    from zerodist.models import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config("bench-25m"))
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine, *_ = zerodist.initialize(model=model, config=config)
    return engine


def _one_step(engine: Any) -> None:
    tokens = torch.randint(0, 256, (1, engine.module.config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()


def _timed(fn: Any) -> float:
    import zerodist.comm as comm

    os.sync()  # no earlier write still being flushed while this one is timed
    comm.barrier()
    started = time.perf_counter()
    fn()
    comm.barrier()
    elapsed = torch.tensor([time.perf_counter() - started])
    comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
    return float(elapsed)


def _torch_save(tensors: dict[str, torch.Tensor], path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _copy_into(loaded: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for key, value in loaded.items():
        targets[key].copy_(value)


def measure(stage: int, repeats: int, root: Path) -> dict[str, Any]:
    """On every rank; returns the timings (seconds, slowest rank) and the bytes written."""
    import zerodist.comm as comm
    from zerodist.checkpoint.shards import collect_chunks

    engine = _engine(stage)
    _one_step(engine)
    rank = comm.get_rank()
    chunks, _ = collect_chunks(engine.groups, engine.optimizer.inner.state)
    # Clones: torch.save of a view writes the whole buffer it views (the full flat buffer at stage 2).
    tensors = {f"{i}.{kind}": t.clone() for i, (kind, t) in enumerate(chunks)}
    times: dict[str, list[float]] = {k: [] for k in ("zerodist save", "torch.save", "torch.save + fsync",
                                                      "zerodist load", "torch.load", "torch.load + copy")}
    fresh = _engine(stage)
    fresh_tensors: dict[str, torch.Tensor] = {}
    plain = root / f"plain-r{rank}.pt"
    for repeat in range(repeats):
        # Each write goes to a fresh file after the previous one of its kind is deleted (as keep_last
        # would), so every variant allocates the same way.
        if repeat and rank == 0:
            shutil.rmtree(root / "zerodist" / f"t{repeat - 1}")
        comm.barrier()
        times["zerodist save"].append(_timed(lambda: engine.save_checkpoint(root / "zerodist", tag=f"t{repeat}")))
        plain.unlink(missing_ok=True)
        times["torch.save"].append(_timed(lambda: _torch_save(tensors, plain, fsync=False)))
        plain.unlink()
        times["torch.save + fsync"].append(_timed(lambda: _torch_save(tensors, plain, fsync=True)))
        times["zerodist load"].append(_timed(lambda: fresh.load_checkpoint(root / "zerodist", tag=f"t{repeat}")))
        if not fresh_tensors:  # the loaded engine's tensors: where a plain load would have to copy to
            fresh_tensors = {f"{i}.{kind}": t for i, (kind, t) in
                             enumerate(collect_chunks(fresh.groups, fresh.optimizer.inner.state)[0])}
        times["torch.load"].append(_timed(lambda: torch.load(plain, weights_only=True)))
        times["torch.load + copy"].append(_timed(lambda: _copy_into(torch.load(plain, weights_only=True), fresh_tensors)))
    last = root / "zerodist" / f"t{repeats - 1}"
    written = torch.tensor([sum(f.stat().st_size for f in last.iterdir() if f"-r{rank:05d}-" in f.name or
                                (rank == 0 and f.name == "manifest.json")), plain.stat().st_size])
    comm.all_reduce(written)
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "min_s": {k: min(v) for k, v in times.items()}, "all_s": times,
            "zerodist_bytes": int(written[0]), "torch_bytes": int(written[1]),
            "params": sum(p.numel() for p in engine.module.parameters())}


def _worker(rank: int, world: int, port: int, stage: int, repeats: int, root: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZERODIST_LOG_LEVEL="WARNING")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result = measure(stage, repeats, Path(root))
    if rank == 0:
        out.put(result)


def run(world: int, stage: int, repeats: int, directory: str | None) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=directory) as root:
        mp.start_processes(_worker, args=(world, port, stage, repeats, root, out), nprocs=world, start_method="spawn")
        return out.get()


def format_table(rows: list[dict[str, Any]]) -> str:
    ops = ["zerodist save", "torch.save", "torch.save + fsync", "zerodist load", "torch.load", "torch.load + copy"]
    lines = ["| ranks | stage | bytes per checkpoint (zerodist / torch) | " + " | ".join(ops)
             + " | save / torch.save+fsync | load / torch.load |", "|" + "---|" * (len(ops) + 5)]
    for r in rows:
        m, low = r["median_s"], r["min_s"]
        lines.append(f"| {r['ranks']} | {r['stage']} | {r['zerodist_bytes'] / 2**20:.0f} / {r['torch_bytes'] / 2**20:.0f} MiB | "
                     + " | ".join(f"{m[o]:.2f} s ({low[o]:.2f})" for o in ops)
                     + f" | {m['zerodist save'] / m['torch.save + fsync']:.2f}x | {m['zerodist load'] / m['torch.load']:.2f}x |")
    return "\n".join(lines) + "\n\nmedian (minimum) seconds, slowest rank; ratios of medians"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        result = run(world, args.stage, args.repeats, args.dir)
        rows.append({"ranks": world, "stage": args.stage, **result})
        print(f"{world} rank(s): " + ", ".join(f"{k} {v:.3f} s" for k, v in result["median_s"].items()), flush=True)
    table = format_table(rows)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"checkpoint-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    stem.with_suffix(".md").write_text(f"GPT bench-25m ({rows[0]['params']:,} parameters), fp32 AdamW, "
                                       f"median of {args.repeats}\n\n{table}\n")


if __name__ == "__main__":
    main()
