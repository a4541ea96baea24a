"""Run a command that starts a process group (zerodist run / train / bench) without leaking it.

`subprocess.run(..., timeout=...)` kills only the direct child on timeout: torchrun's worker
ranks would live on as orphans, possibly stuck in a rendezvous. Here the command gets its own
session and the whole group is killed when the deadline passes, and the test fails saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


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
