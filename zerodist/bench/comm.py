"""Collective bandwidth, nccl-tests style, through zerodist.comm (and optionally raw torch).

For each op and each power-of-two size: a median over trials (a barrier before each, so every
trial starts together), algbw = size / time, busbw = algbw x bus factor (see [Note: bandwidth
conventions] in zerodist/comm/tracer.py), and a check of the result against the value it must
have. A size's time is the slowest rank's median.

`compare_raw` times the same op through torch.distributed directly, trial for trial
interleaved with the zerodist call (alternating which goes first); the zerodist/raw ratio is
the median of the per-pair ratios, so it measures zerodist's own overhead and not the
machine's drift. This is the one place outside
zerodist/comm that calls torch.distributed, since it is what we compare against.

DeepSpeed's comms logger reports an all_reduce "throughput" of 2S/t, that is 2 x algbw: on n
ranks it is busbw x n/(n-1) (2x on two ranks), so its numbers are not comparable with busbw.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerodist import comm
from zerodist.utils import format_bytes

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEEPSPEED_NOTE = (
    "DeepSpeed's comms logger reports all_reduce 'throughput' as 2S/t = 2 x algbw, which is busbw x n/(n-1) "
    "({ratio:.2f}x busbw on {n} ranks); busbw here follows nccl-tests (all_reduce 2(n-1)/n x algbw)."
)
_BINARY_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
_raw_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_raw_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    ops: tuple[str, ...] = OPS
    min_bytes: int = 2**10
    max_bytes: int = 64 * 2**20
    trials: int = 20
    warmups: int = 5
    dtype: str = "float32"
    compare_raw: bool = False


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One op at one size. Times are the slowest rank's median, in seconds."""

    op: str
    num_bytes: int
    numel: int
    dtype: str
    world_size: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool
    raw_time_s: float | None = None
    raw_busbw_gbps: float | None = None
    ratio: float | None = None
    """zerodist busbw / raw busbw (1.0: no overhead; 0.98: 2% slower): the median over trials
    of raw time / zerodist time in the same interleaved pair, median over ranks. Pairing
    cancels most of a shared machine's drift, which the ratio of two medians would not."""


def parse_bytes(text: str | int) -> int:
    """'1K' -> 1024, '64M' / '64MiB' / '64MB' -> 64 * 2**20, '512' -> 512 (binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+)\s*([kmg]?)(?:i?b)?\s*", str(text).lower())
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 512, 1K, 64M, 1G (binary units)")
    return int(match.group(1)) * _BINARY_UNITS[match.group(2)]


def power_of_two_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from the first >= min_bytes to max_bytes inclusive."""
    if min_bytes > max_bytes:
        raise ValueError(f"min size {min_bytes} B is larger than max size {max_bytes} B")
    size = 1 << max(0, (min_bytes - 1).bit_length())
    sizes = []
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


class _Case:
    """One op at one size on this rank: buffers, both ways of issuing it, and its expected result."""

    def __init__(self, op: str, numel: int, dtype: torch.dtype, device: torch.device):
        self.op = op
        n, rank = comm.get_world_size(), comm.get_rank()
        shard = numel // n
        index = torch.arange(n, dtype=torch.float64, device=device).repeat_interleave(shard)
        if op == "all_reduce":
            self.source = torch.full((numel,), float(rank + 1), dtype=dtype, device=device)
            self.expected = torch.full((numel,), n * (n + 1) / 2, dtype=dtype, device=device)
        elif op == "broadcast":
            self.source = torch.full((numel,), 42.0 if rank == 0 else -1.0, dtype=dtype, device=device)
            self.expected = torch.full((numel,), 42.0, dtype=dtype, device=device)
        elif op == "reduce_scatter":  # chunk j on rank q holds (q+1)(j+1): rank r gets (r+1) n(n+1)/2
            self.input = ((index + 1) * (rank + 1)).to(dtype)
            self.expected = torch.full((shard,), (rank + 1) * n * (n + 1) / 2, dtype=dtype, device=device)
        elif op == "all_gather":
            self.input = torch.full((shard,), float(rank + 1), dtype=dtype, device=device)
            self.expected = (index + 1).to(dtype)
        elif op == "all_to_all":  # chunk j on rank q holds q*n + j + 1; rank r receives chunk r of each
            self.input = (rank * n + index + 1).to(dtype)
            self.expected = (index * n + rank + 1).to(dtype)
        else:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
        self.output = torch.empty_like(self.expected)

    def prepare(self) -> None:
        """Reset the buffer the op writes, so the check after the last trial means something."""
        if self.op in ("all_reduce", "broadcast"):
            self.output.copy_(self.source)
        else:
            self.output.fill_(-7.0)

    def run_zerodist(self) -> None:
        if self.op == "all_reduce":
            comm.all_reduce(self.output)
        elif self.op == "broadcast":
            comm.broadcast(self.output, src=0)
        elif self.op == "reduce_scatter":
            comm.reduce_scatter(self.output, self.input)
        elif self.op == "all_gather":
            comm.all_gather(self.output, self.input)
        else:
            comm.all_to_all_single(self.output, self.input)

    def run_raw(self) -> None:
        if self.op == "all_reduce":
            dist.all_reduce(self.output)
        elif self.op == "broadcast":
            dist.broadcast(self.output, src=0)
        elif self.op == "reduce_scatter":
            _raw_reduce_scatter(self.output, self.input)
        elif self.op == "all_gather":
            _raw_all_gather(self.output, self.input)
        else:
            dist.all_to_all_single(self.output, self.input)

    def correct(self) -> bool:
        tolerance = 0.0 if self.expected.dtype in (torch.float32, torch.float64) else 1e-2
        return bool(torch.allclose(self.output.double(), self.expected.double(), rtol=tolerance, atol=0.0))


def _numel_for(op: str, num_bytes: int, element_size: int, world_size: int) -> int:
    """Elements of the op's full buffer; ops that split it need a multiple of the world size."""
    numel = num_bytes // element_size
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        numel -= numel % world_size
    return numel


def _time_case(case: _Case, options: BenchOptions, sync: Callable[[], None]) -> tuple[list[float], list[float], bool]:
    """This rank's zerodist (and raw) trial times, and whether the zerodist result was right."""
    ours: list[float] = []
    raw: list[float] = []
    ways = [(True, case.run_zerodist, ours)] + ([(False, case.run_raw, raw)] if options.compare_raw else [])
    last_trial = options.warmups + options.trials - 1
    correct = True
    for trial in range(last_trial + 1):
        for is_ours, run, times in ways if trial % 2 == 0 else ways[::-1]:
            case.prepare()
            comm.barrier()
            start = time.perf_counter()
            run()
            sync()
            elapsed = time.perf_counter() - start
            if trial >= options.warmups:
                times.append(elapsed)
            if is_ours and trial == last_trial:
                correct = case.correct()
    return ours, raw, correct


def run_comm_bench(options: BenchOptions) -> list[BenchRow]:
    """Run every op at every size on every rank (collective); every rank returns the same rows."""
    n = comm.get_world_size()
    device = comm.device_for_rank()
    dtype = DTYPES[options.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    local: list[tuple[str, int, int, float, float | None, float | None, bool]] = []
    for op in options.ops:
        for num_bytes in power_of_two_sizes(options.min_bytes, options.max_bytes):
            numel = _numel_for(op, num_bytes, element, n)
            if numel < 1:
                continue  # too small to split across the ranks
            ours, raw, correct = _time_case(_Case(op, numel, dtype, device), options, sync)
            paired = statistics.median(r / o for r, o in zip(raw, ours)) if raw else None
            local.append((op, numel, numel * element, statistics.median(ours),
                          statistics.median(raw) if raw else None, paired, correct))
    everyone: list[Any] = [None] * n
    comm.all_gather_object(everyone, local)
    return [_combine(options, n, [rank_rows[i] for rank_rows in everyone]) for i in range(len(local))]


def _combine(options: BenchOptions, n: int, per_rank: list[tuple]) -> BenchRow:
    op, numel, num_bytes = per_rank[0][:3]
    time_s = max(r[3] for r in per_rank)
    raw_time = max(r[4] for r in per_rank) if options.compare_raw else None
    paired = statistics.median(r[5] for r in per_rank) if options.compare_raw else None
    factor = comm.bus_factor(op, n)
    algbw = num_bytes / time_s / 1e9
    return BenchRow(
        op, num_bytes, numel, options.dtype, n, time_s, algbw, algbw * factor, all(r[6] for r in per_rank),
        raw_time, None if raw_time is None else num_bytes / raw_time / 1e9 * factor, paired,
    )


def format_table(rows: list[BenchRow], *, backend: str, device: str, options: BenchOptions) -> str:
    """The on-screen table, with the conventions spelled out under it."""
    n = rows[0].world_size if rows else comm.get_world_size()
    lines = [
        f"zerodist bench comm: {n} ranks, backend {backend}, device {device}, {options.dtype}, "
        f"median of {options.trials} trials ({options.warmups} warm-ups), barrier before each; slowest rank's median",
        f"{'op':<15}{'size':>11}{'elements':>11}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}{'result':>8}"
        + (f"{'raw busbw':>11}{'zd/raw':>8}" if options.compare_raw else ""),
    ]
    for r in rows:
        line = (f"{r.op:<15}{format_bytes(r.num_bytes):>11}{r.numel:>11}{r.time_s * 1e6:>11.1f}"
                f"{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}{'ok' if r.correct else 'WRONG':>8}")
        if r.raw_busbw_gbps is not None:
            line += f"{r.raw_busbw_gbps:>11.3f}{r.ratio:>8.3f}"
        lines.append(line)
    lines.append("busbw = algbw x factor (nccl-tests): all_reduce 2(n-1)/n, reduce_scatter/all_gather/all_to_all "
                 "(n-1)/n, broadcast 1; size = the full buffer (gathered output, unreduced input).")
    if n > 1:
        lines.append(DEEPSPEED_NOTE.format(ratio=n / (n - 1), n=n))
    return "\n".join(lines)


CSV_COLUMNS = ("op", "size_bytes", "numel", "dtype", "world_size", "time_us", "algbw_gbps", "busbw_gbps", "correct",
               "raw_time_us", "raw_busbw_gbps", "zerodist_over_raw")


def row_record(row: BenchRow) -> dict[str, Any]:
    """One row as plain values (the CSV's and JSON's columns)."""
    return {
        "op": row.op, "size_bytes": row.num_bytes, "numel": row.numel, "dtype": row.dtype,
        "world_size": row.world_size, "time_us": round(row.time_s * 1e6, 3), "algbw_gbps": round(row.algbw_gbps, 6),
        "busbw_gbps": round(row.busbw_gbps, 6), "correct": "ok" if row.correct else "WRONG",
        "raw_time_us": None if row.raw_time_s is None else round(row.raw_time_s * 1e6, 3),
        "raw_busbw_gbps": None if row.raw_busbw_gbps is None else round(row.raw_busbw_gbps, 6),
        "zerodist_over_raw": None if row.ratio is None else round(row.ratio, 4),
    }


def write_outputs(rows: list[BenchRow], out_dir: str, meta: dict[str, Any]) -> list[str]:
    """bench_comm.csv, bench_comm.json and bench_comm.png (busbw vs size) in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    records = [row_record(r) for r in rows]
    csv_path = os.path.join(out_dir, "bench_comm.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in rec.items()} for rec in records)
    json_path = os.path.join(out_dir, "bench_comm.json")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": records}, f, indent=1)
    png_path = os.path.join(out_dir, "bench_comm.png")
    plot_bus_bandwidth(rows, png_path, title=f"{meta.get('world_size')} ranks, {meta.get('backend')}, {meta.get('dtype')}")
    return [csv_path, json_path, png_path]


def plot_bus_bandwidth(rows: list[BenchRow], path: str, title: str = "") -> None:
    """Bus bandwidth vs message size, one line per op (dashed: raw torch.distributed)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        line, = ax.plot([r.num_bytes for r in mine], [r.busbw_gbps for r in mine], marker="o", label=op)
        if mine[0].raw_busbw_gbps is not None:
            raw = [r.raw_busbw_gbps for r in mine]  # every row of the op has one when its first has
            ax.plot([r.num_bytes for r in mine], raw, linestyle="--",  # type: ignore[arg-type]
                    color=line.get_color(), label=f"{op} (raw torch)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes, full buffer)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"zerodist bench comm: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
