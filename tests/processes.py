"""Run a command that starts a process group (zerodist run / train / bench) without leaking it;
and the suite's warm forkserver, from which the harness's ranks and the crash tests' ranks fork.

`subprocess.run(..., timeout=...)` kills only the direct child on timeout: torchrun's worker
ranks would live on as orphans, possibly stuck in a rendezvous. Here the command gets its own
session and the whole group is killed when the deadline passes, and the test fails saying so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
from typing import Any

_warm: Any = None
# The environment and directory of the session's start (this module is imported with the harness,
# by conftest.py): the forkserver starts from them, whichever test first needs it, so that a test's
# monkeypatched variable or chdir never becomes every later rank's.
_SESSION_ENV, _SESSION_CWD = dict(os.environ), os.getcwd()


def _cuda_visible() -> bool:
    """Whether torch sees a CUDA device (asking initializes no CUDA context)."""
    import torch

    return torch.cuda.is_available()


# [Note: no fork where CUDA is]
# A process forked after CUDA was initialized cannot use it ("Cannot re-initialize CUDA in forked
# subprocess"). On the first GPU run (H200, torch 2.11) every test of the GPU tier failed so at
# start-up: something the warm server ran had initialized CUDA (not pinned down; importing torch and
# zerodist, an AdamW step and a config load each left it uninitialized when tried alone there).
# Where torch sees a CUDA device the ranks are spawned instead, each importing torch itself: seconds
# per pool, on machines with the cores for it.
def warm_context() -> Any:
    """A multiprocessing context whose processes fork from one server that imported torch, zerodist
    and what the first step imports (tests/warm_start.py), once per session: a rank then starts in
    a fraction of a second instead of paying ~3 s of CPU for its imports (spawn). The server ran no
    torch op on more than one thread and holds no socket, so forking it is safe. A forked rank gets
    the server's environment and working directory: the session's at its start, not those of the
    test that first needs the server, so a body sets what it needs in os.environ itself."""
    global _warm
    if _warm is None and _cuda_visible():
        _warm = mp.get_context("spawn")  # [Note: no fork where CUDA is]
    if _warm is None:
        from multiprocessing import forkserver

        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["tests.warm_start"])
        environment, directory = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(_SESSION_ENV)
        os.chdir(_SESSION_CWD)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(environment)
            os.chdir(directory)
        _warm = context
    return _warm


def run_group(args: list[str], *, timeout: float, capture_output: bool = True, text: bool = True,
              **kwargs: Any) -> subprocess.CompletedProcess:
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(args)} ran past {timeout:.0f}s and was killed with its process group\n"
                             f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-3000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
