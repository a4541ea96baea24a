"""conftest.py of the conformance work directory (written by run.py): runs each DistributedTest
method on its world size, in forked ranks on gloo with zerodist serving ``import deepspeed``."""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback

import pytest

from unit.common import DistributedTest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, method, kwargs, write_fd: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZERODIST_TIMEOUT="60")
    status = 0
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        method(**kwargs)
        import torch.distributed as dist

        if dist.is_initialized():  # rank 0 holds the store: nobody leaves while others still use it
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as error:  # reported to the parent
        message = "".join(traceback.format_exception(error))
        if isinstance(error, pytest.skip.Exception):
            message = "SKIP " + str(error)
            status = 3
        else:
            status = 1
        os.write(write_fd, f"rank {rank}: {message}"[-6000:].encode())
    os._exit(status)


def _run_on_ranks(method, kwargs, world_size: int, timeout: float) -> None:
    port, children = _port(), []
    for rank in range(world_size):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _rank_main(rank, world_size, port, method, kwargs, write_fd)
        os.close(write_fd)
        children.append((rank, pid, read_fd))
    deadline, failures, skipped = time.monotonic() + timeout, [], []
    for rank, pid, read_fd in children:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                for _, other, _ in children:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
                failures.append(f"rank {rank}: timed out after {timeout:.0f}s")
                status = 0
                break
            time.sleep(0.05)
        message = os.read(read_fd, 65536).decode(errors="replace")
        os.close(read_fd)
        code = os.waitstatus_to_exitcode(status) if status else 0
        if code == 3:
            skipped.append(message)
        elif code != 0 or message:
            failures.append(message or f"rank {rank} exited with {code}")
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    if skipped:
        pytest.skip(skipped[0])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    cls = pyfuncitem.cls
    if cls is None or not issubclass(cls, DistributedTest):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    sizes = cls.world_size if isinstance(cls.world_size, list) else [cls.world_size]
    for world_size in sizes:
        # ZERODIST_CONFORMANCE_TIMEOUT (run.py --timeout) raises every test's limit on a loaded machine.
        timeout = os.environ.get("ZERODIST_CONFORMANCE_TIMEOUT") or getattr(cls, "exec_timeout", 120)
        _run_on_ranks(pyfuncitem.obj, kwargs, int(world_size), float(timeout))
    return True
