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
