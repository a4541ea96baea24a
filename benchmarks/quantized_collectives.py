"""The cost of ZeRO++'s quantized collectives (zerodist/comm/quantized.py) on loopback, against
the plain collectives they replace, and what they would cost on real links.

    python benchmarks/quantized_collectives.py [--ranks 2|4] [--numel 4194304] [--rounds 10]

gloo ranks on one machine, one thread each. Interleaved in each round, on the same warm
processes (a barrier before each call), for a gradient bucket of `--numel` elements and a
weight shard of `--numel / ranks`:
- reduce-scatter: plain `comm.reduce_scatter` in fp32 and bf16; `quantized_reduce_scatter` at
  int8 and int4 (and, with --ranks 4, hierarchical as 2 nodes x 2 ranks);
- all-gather: plain `comm.all_gather` in bf16; `quantized_all_gather` at int8;
- the local compute alone: quantize + dequantize of the same data, no collective.
Reported: medians per call, ratios against the bf16 collective of the same round, the bytes the
tracer recorded, and a time model for real links: bytes per rank on the wire (bus bytes) over
25 and 100 Gb/s plus the measured local quantize/dequantize compute. Loopback has one bandwidth
for every link and copies are cheap, so the speed-up shows up in bytes and in the model, not in
loopback time. A benchmark, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WORKER_FLAG = "--worker"
BLOCK = 256


def _timed(function, barrier) -> float:
    barrier()
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def _cases(numel: int, world: int) -> dict:
    """name -> (callable, what it moves); built on every rank in the same order."""
    import torch

    import zerodist.comm as comm
    from zerodist.comm.quantize import dequantize_rows, quantize_rows
    from zerodist.comm.quantized import quantized_all_gather, quantized_reduce_scatter

    rank = comm.get_rank()
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    grads_bf16 = grads.to(torch.bfloat16)
    shard = grads[: numel // world].to(torch.bfloat16)
    out32, out16 = torch.empty(numel // world), torch.empty(numel // world, dtype=torch.bfloat16)
    gathered = torch.empty(numel, dtype=torch.bfloat16)

    def round_trip(bits: int) -> None:
        rows = grads.reshape(world, -1)
        dequantize_rows(*quantize_rows(rows, bits, BLOCK), bits, rows.shape[1])

    cases = {
        "rs fp32": lambda: comm.reduce_scatter(out32, grads.clone()),
        "rs bf16": lambda: comm.reduce_scatter(out16, grads_bf16.clone()),
        "qgZ int8": lambda: quantized_reduce_scatter(grads, None, 8, BLOCK),
        "qgZ int4": lambda: quantized_reduce_scatter(grads, None, 4, BLOCK),
        "ag bf16": lambda: comm.all_gather(gathered, shard),
        "qwZ int8": lambda: quantized_all_gather(shard, None, 8, BLOCK),
        "compute int8": lambda: round_trip(8),
        "compute int4": lambda: round_trip(4),
    }
    if world == 4:
        intra = [comm.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        inter = [comm.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        cases["qgZ int4 2x2"] = lambda: quantized_reduce_scatter(grads, intra, 4, BLOCK, inter_group=inter)
    return cases


def worker(args: argparse.Namespace) -> None:
    import torch

    import zerodist.comm as comm

    torch.set_num_threads(1)
    comm.init_distributed()
    world = comm.get_world_size()
    cases = _cases(args.numel, world)
    barrier = comm.barrier
    moved = {}
    for name, function in cases.items():  # warm-up, and the bytes of each
        with comm.trace() as t:
            function()
        moved[name] = (t.total_bytes(), t.bus_bytes(), [r.bus_bytes for r in t.records])
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(args.rounds):
        names = list(cases)
        names = names[round_index % len(names):] + names[:round_index % len(names)]  # rotate the order
        for name in names:
            times[name].append(_timed(cases[name], barrier))
    if comm.get_rank() == 0:
        result = {name: {"s": statistics.median(values), "bytes": moved[name][0], "bus": moved[name][1],
                         "hops": moved[name][2]}
                  for name, values in times.items()}
        print("RESULT " + json.dumps(result), flush=True)


def _report(r: dict, args: argparse.Namespace) -> None:
    print(f"{args.ranks} gloo ranks on loopback (one machine, loaded: other work shares its cores), "
          f"bucket {args.numel:,} elements, block {BLOCK}, medians of {args.rounds} interleaved rounds")
    print(f"{'call':<14}{'ms':>9}{'x bf16':>8}{'bytes':>12}{'bus bytes':>12}{'25 Gb/s ms':>12}{'100 Gb/s ms':>13}")
    compute = {"qgZ int8": r["compute int8"]["s"], "qgZ int4": r["compute int4"]["s"],
               "qgZ int4 2x2": 2 * r["compute int4"]["s"], "qwZ int8": r["compute int8"]["s"] / args.ranks}
    for name, row in r.items():
        base = r["ag bf16" if name.startswith(("ag", "qwZ")) else "rs bf16"]["s"]
        model = [row["bus"] / (gbps * 1e9 / 8) * 1e3 + compute.get(name, 0.0) * 1e3 for gbps in (25, 100)]
        wire = "" if name.startswith("compute") else f"{model[0]:>12.2f}{model[1]:>13.2f}"
        print(f"{name:<14}{row['s'] * 1e3:>9.2f}{row['s'] / base:>8.2f}{row['bytes']:>12,}{row['bus']:>12,.0f}{wire}")
    if "qgZ int4 2x2" in r:
        inter = r["qgZ int4 2x2"]["hops"][-1]
        print(f"hierarchical qgZ int4, 2 nodes x 2: the inter-node hop sends {inter:,.0f} bus bytes per rank, "
              f"{inter / r['rs bf16']['bus']:.3f}x a bf16 reduce-scatter over the 4 ranks (all of which crosses nodes)")
    print("time model: bus bytes (what one rank sends) / link bandwidth, plus the measured quantize+dequantize "
          "compute (the hierarchical one quantizes twice); every link at the given speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4))
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.numel % (args.ranks * BLOCK):
        parser.error(f"--numel must be a multiple of nproc x {BLOCK}")
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", str(args.ranks), __file__, "--numel",
               str(args.numel), "--rounds", str(args.rounds), "--ranks", str(args.ranks), WORKER_FLAG]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
    if line is None:
        print(f"failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return
    _report(json.loads(line[len("RESULT "):]), args)


if __name__ == "__main__":
    main()
