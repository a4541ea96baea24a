"""Past one machine: step time and bytes per link class of plain ZeRO-3, MiCS, hpZ, qwZ, qgZ and all
three ZeRO++ levers, on 4 ranks as 2 simulated nodes x 2 (gloo, CPU, one thread each).

    PYTHONPATH=. python benchmarks/zeropp_bench.py [--model bench-25m] [--rounds 5]

One command prints the section for benchmarks/README.md (its heading, the command, the table).
One process group builds one engine per mode (the same seed, weights and batches) and runs the
modes' steps interleaved, round by round (one warm-up round, then `--rounds` timed ones), so that
machine load hits every mode alike. Each row: the median step time and the median over rounds of
its ratio to plain ZeRO-3's step in the same round, rank 0's bus bytes of one step per link class (the tracer) against docs/design/zero.md's
formula, and a time model for real links: the time one rank's bytes of a step take with the
cross-node links at 25 or 100 Gb/s and the intra-node ones at 100 GB/s (loopback has one bandwidth
for every link, so the saving shows in bytes, not in the loopback step time, which on CPU is
compute: it shows the quantization's cost instead).
Timings on a shared 2-core machine are noisy: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ranks import enter_rank, free_port, run_ranks

WORLD_SIZE, NODES, MICRO_BATCH, SEQ = 4, 2, 4, 128
MODES: dict[str, dict[str, Any]] = {
    "plain ZeRO-3": {},
    "MiCS (`mics_shard_size: 2`)": {"mics_shard_size": 2},
    "hpZ (`zero_hpz_partition_size: 2`)": {"zero_hpz_partition_size": 2},
    "qwZ (int8 gathers)": {"zero_quantized_weights": True},
    "qgZ (int4 gradients)": {"zero_quantized_gradients": True},
    "ZeRO++ (all three)": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                           "zero_quantized_gradients": True},
}


def config(keys: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0, **keys},
            "zerodist": {"simulated_nodes": NODES}}


def bulk_bytes(t: Any) -> dict[str, float]:
    """Bus bytes per link class of the parameter and gradient collectives (the step's scalar
    all-reduces and order checks, a few bytes each, are not in the formulas)."""
    out = {"intra": 0.0, "inter": 0.0}
    for record in t.records:
        if record.numel > 64 and record.link is not None:
            out[record.link] += record.bus_bytes
    return out


def train(model_name: str, rounds: int) -> dict[str, Any]:
    import torch

    import zerodist
    import zerodist.comm as comm
    from zerodist.models import GPT, gpt_config
    from zerodist.zero.link_bytes import step_link_bytes

    model_config = gpt_config(model_name)
    engines = {}
    for name, keys in MODES.items():
        torch.manual_seed(0)
        engines[name] = zerodist.initialize(model=GPT(model_config), config=config(keys))[0]
    rank = comm.get_rank()
    times: dict[str, list[float]] = {name: [] for name in MODES}
    sent: dict[str, dict[str, float]] = {}
    losses: dict[str, float] = {}
    for step in range(rounds + 1):
        seq = min(SEQ, model_config.seq_len)
        ids = torch.randint(0, model_config.vocab_size, (WORLD_SIZE * MICRO_BATCH, seq + 1),
                            generator=torch.Generator().manual_seed(step))[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        for name, engine in engines.items():
            comm.barrier()
            with comm.trace() as t:
                started = time.perf_counter()
                loss = engine(ids[:, :-1], ids[:, 1:])
                engine.backward(loss)
                engine.step()
                elapsed = time.perf_counter() - started
            if step:
                times[name].append(elapsed)
            sent[name], losses[name] = bulk_bytes(t), float(loss)
    formula = {name: step_link_bytes(e) for name, e in engines.items()}
    return {"times": times, "sent": sent, "formula": formula, "losses": losses,
            "params": sum(p.numel() for p in GPT(model_config).parameters())}


def worker(rank: int, port: int, model_name: str, rounds: int, folder: str) -> None:
    enter_rank(rank, WORLD_SIZE, port, os.path.join(folder, f"rank{rank}.log"))
    try:
        result = train(model_name, rounds)
    except BaseException:
        traceback.print_exc()
        raise
    if rank == 0:
        Path(folder, "rank0.json").write_text(json.dumps(result))


def report(result: dict[str, Any], model_name: str, rounds: int) -> str:
    base_times = result["times"]["plain ZeRO-3"]
    plain_inter = result["sent"]["plain ZeRO-3"]["inter"]
    when = time.strftime("%Y-%m-%d, %H:%M UTC", time.gmtime())
    lines = [f"## Issue 36: past one machine, ZeRO-3 vs MiCS, hpZ, qwZ, qgZ and ZeRO++ (`zeropp_bench.py`, {when})",
             "", f"`PYTHONPATH=. python benchmarks/zeropp_bench.py --model {model_name} --rounds {rounds}`", "",
             f"{model_name} ({result['params']:,} parameters), ZeRO-3 on {WORLD_SIZE} ranks as {NODES} simulated nodes, "
             f"fp32, micro-batch {MICRO_BATCH} x min({SEQ}, the model's seq_len); median of {rounds} interleaved rounds",
             "", "| mode | step s (loopback) | vs plain | intra MB/step | inter MB/step | inter vs plain | "
             "bytes = formula | comm @25 Gb/s | comm @100 Gb/s | loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in MODES:
        step = statistics.median(result["times"][name])
        ratio = statistics.median(t / b for t, b in zip(result["times"][name], base_times))  # same round
        sent, formula = result["sent"][name], result["formula"][name]
        exact = all(abs(sent[k] - formula[k]) <= 1e-6 * max(formula[k], 1) for k in ("intra", "inter"))
        model = [sent["inter"] * 8 / (gbps * 1e9) + sent["intra"] / 100e9 for gbps in (25, 100)]
        lines.append(f"| {name} | {step:.2f} | {ratio:.2f}x | {sent['intra'] / 1e6:.2f} | "
                     f"{sent['inter'] / 1e6:.2f} | {sent['inter'] / plain_inter:.3f}x | {'yes' if exact else 'no'} | "
                     f"{model[0] * 1e3:.1f} ms | {model[1] * 1e3:.1f} ms | {result['losses'][name]:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-25m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zeropp_bench_") as folder:
        error = run_ranks(worker, (free_port(), args.model, args.rounds, folder), nprocs=WORLD_SIZE,
                          timeout_s=args.timeout)
        if error is not None:
            tail = Path(folder, "rank0.log").read_text(errors="replace").strip().splitlines()[-5:]
            print(f"zeropp_bench: {error}: {' | '.join(tail)}", file=sys.stderr)
            return 1
        result = json.loads(Path(folder, "rank0.json").read_text())
    print(report(result, args.model, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
