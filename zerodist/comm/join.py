"""Joining the world through the launcher's store, saying who waits for whom.

torch's env:// rendezvous is silent: rank 0's store waits for every rank to connect, then the
backend waits for every rank's address, each for up to the collective timeout (30 minutes by
default for gloo), so a rank that never started shows only as a timeout at the end. Here each
rank connects to the store (rank 0 hosts it, or torchrun's agent does) without waiting for the
others, announces itself under a key, and polls for everyone's key, logging while it waits

    rank 0 of 2: waiting for rank 1 at 10.0.0.1:29500 (285 s left of the 300 s join timeout)

and raising `DistributedInitError` naming the missing ranks when the join timeout passes. The
process group is made on that store only once every rank has announced itself.

[Note: join keys] Join n of this process (a process that destroys its group and initialises
again joins again) under torchrun attempt a uses `zerodist/join/<a>/<n>/<rank>`: torchrun's
agent store outlives a restarted attempt, and a reused multi-tenant store keeps an earlier
join's keys, so neither may be mistaken for a rank that is here now.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from zerodist.comm.errors import DistributedInitError
from zerodist.utils import get_logger

logger = get_logger(__name__)

# Without a configured timeout, ranks wait this long for each other at start-up: long enough for
# nodes of a static launch that start minutes apart, far short of torch's 30-minute default.
DEFAULT_JOIN_TIMEOUT_S = 300.0
FIRST_REPORT_S = 5.0  # the first "waiting for" line; a healthy join takes well under a second
REPORT_EVERY_S = 15.0
POLL_S = 0.2

_joins = 0  # how many times this process has joined (see [Note: join keys])


def join_timeout_s(configured: datetime.timedelta | None) -> float:
    """The configured collective timeout bounds joining too; without one, DEFAULT_JOIN_TIMEOUT_S."""
    return DEFAULT_JOIN_TIMEOUT_S if configured is None else configured.total_seconds()


def join_store(rank: int, world_size: int, host: str, port: int, timeout_s: float) -> dist.Store:
    """The world's store once all `world_size` ranks have announced themselves in it.

    Raises `DistributedInitError` after `timeout_s` seconds naming the ranks (or the store) that
    never came; logs who is still missing FIRST_REPORT_S seconds in and every REPORT_EVERY_S after.
    """
    global _joins
    _joins += 1
    clock = _Clock(rank, world_size, f"{host}:{port}", timeout_s)
    store = _connect(rank, world_size, host, port, clock)
    prefix = f"zerodist/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_joins}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    token = os.environ.get("TORCHELASTIC_RUN_ID", "")  # the launcher's id of this job ([Note: job token])
    try:
        if rank == 0:
            store.set(f"{prefix}/job", token)  # before the count: whoever sees everyone arrived can read it
        store.set(keys[rank], "here")  # who came, read only to report who has not
        arrived = store.add(f"{prefix}/count", 1)
        # Polled, not store.wait(): each timed-out wait makes torch log a warning. One counter
        # read per poll keeps a large world's polling cheap for the store.
        while arrived < world_size:
            if clock.left() <= 0 or clock.report_due():
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                if clock.left() <= 0:
                    raise DistributedInitError(
                        f"rank {rank} of {world_size}: {_ranks(missing)} did not join at {clock.address} "
                        f"within {timeout_s:g} s. {_ADVICE}")
                clock.report(f"waiting for {_ranks(missing)}")
            time.sleep(POLL_S)
            arrived = store.add(f"{prefix}/count", 0)
        _check_same_job(store, prefix, arrived, token, rank, world_size, clock)
    except dist.DistError as error:  # the store's host went away: it gave up, or died
        raise DistributedInitError(
            f"rank {rank} of {world_size}: lost the store at {clock.address} while waiting for the other ranks "
            f"({error}); the rank hosting it has exited (see its log). {_ADVICE}") from None
    return store


# [Note: job token] Two jobs given the same MASTER_PORT: the second job's rank 0 cannot bind it,
# and its other ranks reach the first job's store. There, the join count is already complete,
# so one more rank makes it exceed WORLD_SIZE; and rank 0 of every job writes its launcher's
# run id (TORCHELASTIC_RUN_ID), which the other ranks compare with their own. Either way they
# fail at once, by name, instead of waiting in a rendezvous that is not theirs.
def _check_same_job(store: dist.Store, prefix: str, arrived: int, token: str, rank: int, world_size: int,
                    clock: _Clock) -> None:
    if arrived > world_size:
        raise DistributedInitError(
            f"rank {rank} of {world_size}: the store at {clock.address} already counts {arrived} joined ranks, more "
            f"than WORLD_SIZE {world_size}: it belongs to another job (MASTER_PORT shared with a running job), or "
            f"a rank was started twice. Give each job its own MASTER_PORT.")
    theirs = store.get(f"{prefix}/job").decode() if rank != 0 else token
    if theirs != token:
        raise DistributedInitError(
            f"rank {rank} of {world_size}: the store at {clock.address} belongs to another job (run id {theirs!r}, "
            f"this rank's is {token!r}): MASTER_PORT is shared with a running job. Give each job its own "
            "MASTER_PORT.")


_ADVICE = (
    "Every rank must be started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; a rank that "
    "failed before joining shows its own error in its log. The wait is bounded by the collective "
    "timeout (zerodist.timeout in the config, or ZERODIST_TIMEOUT seconds), "
    f"{DEFAULT_JOIN_TIMEOUT_S:g} s when neither is set."
)


def _connect(rank: int, world_size: int, host: str, port: int, clock: _Clock) -> dist.Store:
    """This rank's connection to the store: rank 0 hosts it (unless torchrun's agent does, as
    torch's own env:// rendezvous decides); the others first wait until it listens."""
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    is_server = rank == 0 and not agent_hosts_it
    owner = "torchrun's agent" if agent_hosts_it else "rank 0"
    # A plain socket probe, not TCPStore's own retries: each failed TCPStore connect logs a C++
    # stack trace, and the server ignores a probe that closes without speaking.
    while not is_server and not _listening(host, port):
        if clock.left() <= 0:
            raise DistributedInitError(
                f"rank {rank} of {world_size}: the store at {clock.address} ({owner} hosts it) did not answer "
                f"within {clock.timeout_s:g} s. {_ADVICE}")
        if clock.report_due():
            clock.report(f"waiting for the store ({owner} hosts it)")
        time.sleep(POLL_S)
    # wait_for_workers=False: the server must not block here until every rank connects;
    # join_store's loop does that, reporting as it goes.
    make = functools.partial(dist.TCPStore, host, port, world_size, is_master=is_server,
                             timeout=datetime.timedelta(seconds=max(clock.left(), 10.0)), wait_for_workers=False,
                             multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    try:
        return make() if is_server else _bounded(make, clock, f"rank {rank} of {world_size}")
    except dist.DistError as error:
        what = "host" if is_server else "connect to"
        raise DistributedInitError(f"rank {rank} of {world_size} could not {what} the store at "
                                   f"{clock.address}: {error}") from None


def _bounded(make: Any, clock: _Clock, who: str) -> dist.Store:
    """`make()` (a store client) within the join timeout. A port held by a program that accepts
    connections but is not a store leaves TCPStore's handshake waiting past its own timeout, so
    the client is made in a thread of its own and abandoned (a daemon) when time is up."""
    result: list[Any] = []

    def connect() -> None:
        try:
            result.append(make())
        except BaseException as error:  # handed to the joining thread
            result.append(error)

    thread = threading.Thread(target=connect, name="zerodist-store-connect", daemon=True)
    thread.start()
    thread.join(max(clock.left(), 1.0))
    if not result:
        raise DistributedInitError(
            f"{who}: something listens at {clock.address} but did not answer as a store within "
            f"{clock.timeout_s:g} s: another program (or another job's rank 0) holds MASTER_PORT. {_ADVICE}")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as probe:
            # Probing a local port in the ephemeral range that nobody listens on can connect the
            # socket to itself (TCP simultaneous open); that is not the store.
            return probe.getsockname() != probe.getpeername()
    except OSError:
        return False


class _Clock:
    """The join's deadline and its report schedule."""

    def __init__(self, rank: int, world_size: int, address: str, timeout_s: float):
        self.rank, self.world_size, self.address, self.timeout_s = rank, world_size, address, timeout_s
        self.start = time.monotonic()
        self.next_report = self.start + FIRST_REPORT_S

    def left(self) -> float:
        return self.start + self.timeout_s - time.monotonic()

    def report_due(self) -> bool:
        return time.monotonic() >= self.next_report

    def report(self, what: str) -> None:
        self.next_report = time.monotonic() + REPORT_EVERY_S
        logger.warning("rank %d of %d: %s at %s (%.0f s left of the %g s join timeout)", self.rank,
                       self.world_size, what, self.address, max(0.0, self.left()), self.timeout_s)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"
