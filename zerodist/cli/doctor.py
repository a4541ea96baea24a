"""`zerodist doctor`: what this machine and launch look like, the private torch APIs this torch has,
and one measured all_reduce.

Run it alone (a one-process world) or under a launcher (`zerodist run --nproc 2 -m
zerodist doctor`) to check that every rank can reach every other and at what bandwidth.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time

_LAUNCH_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_",
                    "ZERODIST_")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="versions, backends, launch variables and an all_reduce check")
    p.add_argument("--size-mib", type=float, default=16.0, help="all_reduce message size (default 16 MiB)")
    p.add_argument("--trials", type=int, default=5, help="timed all_reduce repetitions (default 5)")
    p.set_defaults(handler=run)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> list[str]:
    import torch

    from zerodist.comm.init import available_backends

    lines = [
        f"python      {sys.version.split()[0]} ({platform.platform()})",
        f"torch       {torch.__version__}",
        f"zerodist    {_version('zerodist')}",
        f"pydantic    {_version('pydantic')}",
        f"deepspeed   {_version('deepspeed')}",
        "backends    " + ", ".join(
            f"{name}={'yes' if ok else 'no'}" for name, ok in available_backends().items()
        ),
        f"cuda        {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "cuda        none",
    ]
    seen = sorted(k for k in os.environ if k.startswith(_LAUNCH_PREFIXES))
    lines.append("launch vars " + (", ".join(f"{k}={os.environ[k]}" for k in seen) if seen else "none (one-process world)"))
    return lines


def private_api_report() -> list[str]:
    """One line per private torch API zerodist uses (zerodist.compat): whether this torch has it,
    and on a torch without it, what zerodist does instead."""
    import torch

    from zerodist.compat import CHECKED_ON, PRIVATE_APIS

    missing = sum(not api.available for api in PRIVATE_APIS)
    lines = [f"private torch APIs: {len(PRIVATE_APIS) - missing} of {len(PRIVATE_APIS)} present in torch "
             f"{torch.__version__} (checked on {CHECKED_ON})"]
    for api in PRIVATE_APIS:
        status = "ok     " if api.available else "MISSING"
        detail = api.used_for if api.available else f"{api.used_for}; without it: {api.without}"
        lines.append(f"  {status} {api.name}: {detail}")
    return lines


def measure_all_reduce(size_mib: float, trials: int) -> dict:
    """Time an all_reduce of `size_mib` on this rank and check its result."""
    import torch

    import zerodist.comm as comm

    info = comm.init_distributed()
    device = comm.device_for_rank()
    numel = max(1, int(size_mib * 2**20) // 4)
    data = torch.full((numel,), float(info.rank + 1), device=device)
    comm.all_reduce(data.clone())  # warm-up: connections are made lazily
    comm.barrier()
    start = time.perf_counter()
    for _ in range(trials):
        comm.all_reduce(data)
        data.fill_(float(info.rank + 1))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / trials
    comm.all_reduce(data)
    expected = info.world_size * (info.world_size + 1) / 2
    n = info.world_size
    return {
        "rank": info.rank, "host": platform.node(), "backend": info.backend, "device": str(device),
        "source": info.source, "ms": seconds * 1e3, "algbw": numel * 4 / seconds / 1e9,
        "busbw": numel * 4 / seconds / 1e9 * (2 * (n - 1) / n), "correct": bool((data == expected).all()),
    }


def run(args: argparse.Namespace) -> int:
    import zerodist.comm as comm

    result = measure_all_reduce(args.size_mib, args.trials)
    reports: list = [None] * comm.get_world_size()
    comm.all_gather_object(reports, result)
    if result["rank"] != 0:
        return 0 if all(r["correct"] for r in reports) else 1
    print("\n".join(environment_report()))
    print("\n".join(private_api_report()))
    print(f"world       {len(reports)} rank(s), backend {result['backend']}, joined via {result['source']}")
    print(f"all_reduce  {args.size_mib:g} MiB fp32, mean of {args.trials}:")
    for r in reports:
        print(f"  rank {r['rank']:>3} on {r['host']} ({r['device']}): {r['ms']:8.2f} ms  "
              f"algbw {r['algbw']:6.2f} GB/s  busbw {r['busbw']:6.2f} GB/s  result {'ok' if r['correct'] else 'WRONG'}")
    return 0 if all(r["correct"] for r in reports) else 1
