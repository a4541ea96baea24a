"""Throw-away process groups for the crash tests, started in a fraction of a second.

The crash tests kill -9 a rank dozens of times, so each case needs fresh ranks (a killed rank
leaves its peers' process group broken). Ranks are forked from a multiprocessing forkserver
that imported torch and zerodist once and never ran a torch op (so forking it is safe), which
makes a two-rank launch cost a fraction of a second instead of seconds of imports.

`launch(target, world_size, *args, env=...)` runs `target(*args)` on every rank with the
torchrun variables set and returns a `Launch`: exit codes, each rank's return value or
traceback. When a rank dies, the others get a short grace and are then killed: a rank whose
peer vanished may wait in a collective, and that wait is not what these tests examine.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.processes import warm_context

GRACE_AFTER_DEATH_S = 8.0
_get_context = warm_context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Launch:
    exitcodes: list[int | None]
    values: dict[int, Any]
    errors: dict[int, str]

    def check(self) -> list[Any]:
        """Every rank's value, or an AssertionError with every failure."""
        if self.errors or len(self.values) != len(self.exitcodes):
            details = "\n".join(f"---- rank {r} ----\n{e}" for r, e in sorted(self.errors.items()))
            raise AssertionError(f"launch failed: exit codes {self.exitcodes}\n{details}")
        return [self.values[r] for r in range(len(self.exitcodes))]


def _rank_main(rank: int, world_size: int, port: int, env: dict[str, str], target: Callable[..., Any],
               args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ZERODIST_TIMEOUT="30", **env)
    torch.set_num_threads(1)
    logging.getLogger("zerodist").setLevel(env.get("ZERODIST_LOG_LEVEL", "WARNING"))
    try:
        # As bytes: tensors pickled by multiprocessing would be shared through file descriptors
        # that vanish with this process.
        buffer = io.BytesIO()
        torch.save(target(*args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def launch(target: Callable[..., Any], world_size: int, *args: Any, env: dict[str, str] | None = None,
           timeout: float = 60.0) -> Launch:
    ctx = _get_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, env or {}, target, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values, errors = {}, {}
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        _drain(results, values, errors, wait=0.05)
        if any(p.exitcode is not None and p.exitcode < 0 for p in procs):  # a rank was killed
            deadline = min(deadline, time.monotonic() + GRACE_AFTER_DEATH_S)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    _drain(results, values, errors, wait=0.0)
    for r, p in enumerate(procs):
        if r not in values and r not in errors:
            errors[r] = f"rank {r} ended without a result (exit code {p.exitcode})"
    return Launch([p.exitcode for p in procs], values, errors)


def _drain(results: Any, values: dict[int, Any], errors: dict[int, str], wait: float) -> None:
    while True:
        try:
            rank, status, payload = results.get(timeout=wait) if wait else results.get_nowait()
        except queue.Empty:
            return
        if status == "ok":
            values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
        wait = 0.0
