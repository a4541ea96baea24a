"""A pytest-native multi-process harness (in the spirit of DeepSpeed's DistributedTest).

    @distributed_test(world_size=[1, 2, 4])
    def test_something():              # the body runs on every rank
        ...

    results = run_distributed(fn, 2, arg)   # fn runs on each of 2 ranks; returns [rank0, rank1]

Ranks are real processes on gloo over loopback, initialised through zerodist's own launch path
(torchrun variables). Process start-up (importing torch) dominates on small machines, so one
pool of workers per world size lives for the whole session and runs test after test, and its
ranks fork from the suite's warm forkserver (tests.processes.warm_context), which imported torch
once: a pool starts in about a second rather than ~3 s of CPU per rank. A pool
that saw a failure is torn down, since its ranks may be stuck in a collective or out of step,
and the next test gets a fresh one.

A test fails when any rank raises, any rank dies, or the deadline passes; the error carries
every failed rank's traceback and names the ranks that never answered. It never hangs: ranks
still running after a failure are given a short grace, then killed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import queue
import socket
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

import tests.processes  # noqa: F401  (its snapshot of the session's environment: warm_context)

DEFAULT_TIMEOUT_S = 90.0
GRACE_AFTER_FAILURE_S = 3.0
COLLECTIVE_TIMEOUT_S = "60"

_BODIES: dict[tuple[str, str], Callable[..., Any]] = {}


class DistributedTestFailure(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, backend: str, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZERODIST_TIMEOUT=COLLECTIVE_TIMEOUT_S,
    )
    try:
        import torch

        torch.set_num_threads(1)
        import zerodist.comm

        zerodist.comm.init_distributed(backend)
        results.put((rank, None, "ready", None))
    except BaseException:
        results.put((rank, None, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, target, args, kwargs = task
        try:
            value = _resolve(target)(*args, **kwargs)
            results.put((rank, task_id, "ok", value))
        except BaseException:
            results.put((rank, task_id, "error", traceback.format_exc()))


def _resolve(target: Any) -> Callable[..., Any]:
    if isinstance(target, tuple):
        module, name = target
        importlib.import_module(module)
        return _BODIES[(module, name)]
    return target


class WorkerPool:
    """`world_size` worker processes on `backend` that run one task at a time, all ranks together."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        from tests.processes import warm_context

        ctx = warm_context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.task_queues = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.processes = [
            ctx.Process(target=_worker_main, args=(r, world_size, backend, port, self.task_queues[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.processes:
            p.start()
        self.next_id = 0
        self._collect(None, timeout=120.0, what="start-up")

    def run(self, target: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self.next_id += 1
        for q in self.task_queues:
            q.put((self.next_id, target, args, kwargs))
        return self._collect(self.next_id, timeout, what=_describe(target))

    def _collect(self, task_id: int | None, timeout: float, what: str) -> list[Any]:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, tid, status, payload = self.results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in values and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} process died (exit code {self.processes[r].exitcode})"
                continue
            if tid != task_id:
                continue  # a stale answer from an earlier, abandoned task
            if status == "ok" or status == "ready":
                values[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        missing = [r for r in range(self.world_size) if r not in values and r not in errors]
        if errors or missing:
            raise DistributedTestFailure(_report(what, self.world_size, errors, missing, timeout))
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.task_queues:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for p in self.processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def _describe(target: Any) -> str:
    if isinstance(target, tuple):
        return ".".join(target)
    return f"{target.__module__}.{target.__qualname__}"


def _report(what: str, world_size: int, errors: dict[int, str], missing: list[int], timeout: float) -> str:
    lines = [f"{what} failed on {len(errors)} of {world_size} rank(s)"]
    if missing:
        lines[0] += f"; rank(s) {missing} did not finish (deadline {timeout:.0f}s or grace after a failure) and were killed"
    for rank in sorted(errors):
        lines.append(f"---- rank {rank} ----\n{errors[rank]}")
    return "\n".join(lines)


_pools: dict[tuple[int, str], WorkerPool] = {}


def run_distributed(target: Any, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run `target(*args, **kwargs)` on `world_size` ranks; return each rank's value, rank order.

    `target` is a module-level function (sent by reference). Any rank's failure fails the call
    on all ranks with its traceback, within `timeout` seconds. The ranks join on gloo, the CPU
    suite's backend, also where torch sees a GPU; the GPU tier (tests/gpu) asks for "nccl".
    """
    return _run(target, world_size, args, kwargs, timeout, backend)


def _run(target: Any, world_size: int, args: tuple, kwargs: dict, timeout: float, backend: str = "gloo") -> list[Any]:
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = WorkerPool(world_size, backend)
    try:
        return pool.run(target, args, kwargs, timeout)
    except BaseException:
        _pools.pop(key, None)
        pool.close()
        raise


def start_pool(world_size: int) -> None:
    """Have `world_size` ranks up and ready: a test that bounds how long a failure takes to be named
    starts its clock after this, so that the bound never counts a fresh pool's start-up (a pool is
    torn down after every failing test) on a loaded machine."""
    _run(_ready, world_size, (), {}, DEFAULT_TIMEOUT_S)


def _ready() -> None:
    return None


def close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


def distributed_test(world_size: int | list[int] = 2, *, timeout: float = DEFAULT_TIMEOUT_S) -> Callable:
    """Turn a function whose body runs on every rank into a test parametrized by world size.

    The body may take `world_size` and any other parameters given by stacked
    `@pytest.mark.parametrize` decorators. The test is marked `multiprocess`.
    """
    import pytest

    sizes = [world_size] if isinstance(world_size, int) else list(world_size)

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        key = (body.__module__, body.__qualname__)
        _BODIES[key] = body
        body_params = inspect.signature(body).parameters
        takes_world_size = "world_size" in body_params

        @functools.wraps(body)
        def test(world_size: int, **params: Any) -> None:
            if takes_world_size:
                params["world_size"] = world_size
            _run(key, world_size, (), params, timeout)

        others = [p for name, p in body_params.items() if name != "world_size"]
        test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + others
        )
        del test.__wrapped__  # pytest must see our signature, not the body's
        # It runs on worker ranks, so it is in the multiprocess tier ([Note: test tiers] in conftest.py).
        return pytest.mark.multiprocess(pytest.mark.parametrize("world_size", sizes)(test))

    return decorate


def run_cli(world_size: int, *argv: str, timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run `zerodist *argv` (e.g. "train", "--pp", "2", ...) on each of `world_size` pooled ranks,
    as each rank of a `zerodist train --nproc N` launch runs it: `RANK` is set, so the command takes
    its in-place path with this world (a `--nproc` in argv is not read). Returns what the launch's
    `subprocess.run` would: the first non-zero rank's exit code (else 0), and every rank's stdout and
    stderr (the zerodist log included) one after another in rank order.

    What the launch adds around the ranks (torchrun's agent, the pre-spawn checks, leaving
    together) is tested by the CLI tests that start `python -m zerodist`; this spares the tests
    that examine what the ranks compute ~3 s of CPU per rank for a fresh interpreter's imports."""
    ranks = run_distributed(_cli_in_rank, world_size, list(argv), timeout=timeout)
    code = next((code for code, _, _ in ranks if code != 0), 0)
    return subprocess.CompletedProcess(["zerodist", *argv], code, "".join(out for _, out, _ in ranks),
                                       "".join(err for _, _, err in ranks))


def _cli_in_rank(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io
    import logging

    from zerodist.cli.main import main
    from zerodist.utils.logging import get_logger

    get_logger("zerodist")  # its handler exists before the streams are redirected, and is pointed at them
    out, err = io.StringIO(), io.StringIO()
    handlers = [h for h in logging.getLogger("zerodist").handlers if isinstance(h, logging.StreamHandler)]
    streams = [h.setStream(err) for h in handlers]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        for handler, stream in zip(handlers, streams):
            handler.setStream(stream)
    return code, out.getvalue(), err.getvalue()
