"""Joining the world: a rank that never comes is reported while the others wait, and fails them
within the join timeout (zerodist/comm/join.py)."""

from __future__ import annotations

import datetime
import os
from concurrent.futures import ThreadPoolExecutor
import re
import socket
import sys

import pytest

from zerodist.comm.join import DEFAULT_JOIN_TIMEOUT_S, join_timeout_s
from tests.processes import run_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 12  # long enough for the first "waiting" line (due at 5 s), short for a test
# Prints how long init_distributed() took before it raised, measured inside the process.
SCRIPT = (
    "import time, zerodist.comm as c\n"
    "start = time.monotonic()\n"
    "try:\n"
    "    c.init_distributed()\n"
    "finally:\n"
    "    print(f'ELAPSED {time.monotonic() - start:.1f}', flush=True)\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_alone(rank: int, port: int):
    """Start only `rank` of a 2-rank world: the other one never comes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), ZERODIST_TIMEOUT=str(TIMEOUT_S), PYTHONPATH=REPO)
    return run_group([sys.executable, "-c", SCRIPT], env=env, timeout=TIMEOUT_S + 90)


@pytest.fixture(scope="module")
def lone_ranks():
    """Rank 0 alone and rank 1 alone, each in a world of its own port, run at once: each waits out
    the join timeout, idle, so together they take the time of one. {rank: (port, completed process)}"""
    ports = {rank: _free_port() for rank in (0, 1)}
    with ThreadPoolExecutor(2) as pool:
        started = {rank: pool.submit(_start_alone, rank, port) for rank, port in ports.items()}
        return {rank: (ports[rank], future.result()) for rank, future in started.items()}


@pytest.mark.unit
def test_default_join_timeout_is_minutes_and_a_configured_timeout_wins():
    assert join_timeout_s(None) == DEFAULT_JOIN_TIMEOUT_S == 300.0
    assert join_timeout_s(datetime.timedelta(seconds=7)) == 7.0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank0_alone_says_it_waits_for_rank1_then_fails_within_the_timeout(lone_ranks):
    port, out = lone_ranks[0]
    assert out.returncode != 0
    waits = re.findall(rf"rank 0 of 2: waiting for rank 1 at 127\.0\.0\.1:{port} \((\d+) s left of the "
                       rf"{TIMEOUT_S} s join timeout\)", out.stderr)
    assert waits, out.stderr[-3000:]
    # The first line came within 10 s of the start of the join (it is due at 5 s).
    assert int(waits[0]) >= TIMEOUT_S - 10
    assert (f"DistributedInitError: rank 0 of 2: rank 1 did not join at 127.0.0.1:{port} within {TIMEOUT_S} s"
            in out.stderr), out.stderr[-3000:]
    elapsed = float(re.search(r"ELAPSED ([\d.]+)", out.stdout).group(1))
    assert elapsed >= TIMEOUT_S  # it waited the configured time, not torch's 30 minutes (run_group's bound)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank1_alone_says_it_waits_for_rank0s_store_then_fails(lone_ranks):
    port, out = lone_ranks[1]
    assert out.returncode != 0
    assert re.search(rf"rank 1 of 2: waiting for the store \(rank 0 hosts it\) at 127\.0\.0\.1:{port} "
                     rf"\(\d+ s left of the {TIMEOUT_S} s join timeout\)", out.stderr), out.stderr[-3000:]
    assert (f"rank 1 of 2: the store at 127.0.0.1:{port} (rank 0 hosts it) did not answer within {TIMEOUT_S} s"
            in out.stderr), out.stderr[-3000:]
    # torch's own connect retries would each log a C++ stack trace; the probe keeps stderr readable
    assert "frame #" not in out.stderr
