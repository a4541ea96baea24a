"""Run a benchmark's ranks in fresh processes and wait for them under a deadline (shared by the
benchmark scripts; they run as `python benchmarks/<script>.py`, so this file is importable as
`ranks`)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enter_rank(rank: int, world_size: int, port: int, log_path: str) -> None:
    """In a rank's fresh process: torchrun's variables for one machine, one thread (torch and OpenMP),
    DeepSpeed on its CPU accelerator, and stdout and stderr into `log_path`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch

    torch.set_num_threads(1)


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, timeout_s: float) -> str | None:
    """Start `nprocs` processes running `worker(rank, *args)` and wait for all of them.

    None when every rank finished; otherwise why not ("timed out after N s", or "failed" when a
    rank raised: its log says how). Ranks still alive then are terminated, so a benchmark never
    hangs on a rank that waits for a dead peer."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    error = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout_s:.0f} s"
                break
    except Exception:  # a rank failed: its log ends with the exception
        error = "failed"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    return error


def run_arm(script: str, arm: str, worker: Callable[..., None], args: tuple[Any, ...], *, folder: str, nprocs: int,
            timeout_s: float) -> dict[str, Any] | None:
    """One arm in fresh processes: `worker(rank, port, *args)`, which logs to `folder/<arm>-rank<r>.log`
    (`enter_rank`) and leaves its result in `folder/<arm>.json`. That result, or None after printing
    why the arm failed and the end of every rank's log to stderr."""
    import json
    import sys
    from pathlib import Path

    error = run_ranks(worker, (free_port(), *args), nprocs=nprocs, timeout_s=timeout_s)
    if error is not None:
        print(f"{script}: {arm}: {error}", file=sys.stderr)
        for rank in range(nprocs):
            log = Path(folder, f"{arm}-rank{rank}.log")
            tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else ["(no log)"]
            print(f"  rank {rank}: {' | '.join(tail)}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(Path(folder, f"{arm}.json").read_text())
    return result
