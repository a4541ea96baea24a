"""The hang watchdog: a rank blocked in a collective says whom it waits for, then fails by name.

A collective that one rank never joins (ranks disagree on the order of collectives, a rank is
frozen or computing forever) blocks the others until the backend's timeout, and then gloo says
"Timed out waiting 600000ms for recv operation" without naming anyone. Here every collective
issued through `zerodist.comm` gets a sequence number within its process group (one counter
increment on the hot path), and the main thread marks where it blocks (a synchronous
collective, `CommHandle.wait()`, a store exchange). A daemon thread looks every second: once a
block has lasted `publish_after` seconds it writes this rank's position to the store, and at the
warning threshold it reads every other rank's position and logs

    rank 0: waiting 15 s for rank(s) [1] at barrier #3 on group 'world' (ranks 0-1) at train.py:40 main;
    rank 1 is at all_reduce #12 on group '1' (ranks 0-1) at zerodist/zero/bucket.py:173 start_grad_sync <- ...

repeating every `REPEAT_S`. When the backend's timeout ends the block (the collective timeout:
`zerodist.timeout`, `ZERODIST_TIMEOUT`, else `DEFAULT_COLLECTIVE_TIMEOUT_S`), or a peer's
connection drops, the error becomes `CollectiveTimeoutError` / `CollectiveError` carrying the
same description, on every rank that was blocked.

    ZERODIST_HANG_WARNING=5 (seconds)    set_hang_warning(5)    config: zerodist.hang_warning

[Note: watchdog cost] Nothing on the hot path touches the store or walks the stack: the call site
is read by the watchdog thread from the blocked thread's current frame (`sys._current_frames`),
and positions are written only for blocks longer than `publish_after`. A healthy run writes
nothing. Reading the other ranks' positions costs one store round trip per rank per report.
Keys: `zerodist/watchdog/<attempt>/<rank>`, one per rank, overwritten.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from zerodist import compat
from zerodist.comm import timeline
from zerodist.utils import get_logger

logger = get_logger(__name__)

WARNING_ENV_VAR = "ZERODIST_HANG_WARNING"
DEFAULT_WARNING_S = 15.0
# NCCL's own default in torch; gloo's is 30 minutes, which turned a desync into half an hour of silence.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
REPEAT_S = 30.0
STORE_TIMEOUT_S = 5.0
# How long a rank that failed in a collective keeps the store up at exit for its peers to read why
# ([Note: the failed rank lingers]).
LINGER_S = 5.0
# How long a rank whose peer's connection closed waits for that peer to say why ([Note: a lost
# connection after a peer's timeout]).
PEER_REPORT_WAIT_S = 3.0

_COMM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(_COMM_DIR.rstrip(os.sep)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class CollectiveError(RuntimeError):
    """A collective failed while this rank waited in it (a peer left, or the backend gave up)."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the collective timeout: some rank never joined it.
    `story`: whom this rank waited for and where they were, without the advice about which
    timeout applies (a caller with a timeout of its own, as a pipeline stage's, names its own)."""

    def __init__(self, message: str, story: str = ""):
        super().__init__(message)
        self.story = story or message


class Ticket(NamedTuple):
    """One collective (or store exchange) as the watchdog names it (a tuple: made per collective)."""

    op: str
    group: str
    ranks: tuple[int, ...]
    seq: int

    def describe(self) -> str:
        if self.group.startswith("exchange:"):  # a store exchange has no process group
            return f"{self.op} #{self.seq} (ranks {format_ranks(self.ranks)}, through the store)"
        return f"{self.op} #{self.seq} on group '{self.group}' (ranks {format_ranks(self.ranks)})"


@dataclasses.dataclass
class _Block:
    ticket: Ticket
    started: float  # monotonic
    thread_id: int
    warned_at: float = -REPEAT_S


def format_ranks(ranks: Any) -> str:
    """`[0, 1, 2, 5]` -> `'0-2, 5'`."""
    ordered = sorted(ranks)
    if not ordered:
        return "none"
    parts, start, prev = [], ordered[0], ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


class Watchdog:
    """This process's sequence numbers, its current block, and the thread that reports on it."""

    def __init__(self) -> None:
        self.warning_s = _warning_from_env()
        self._groups: dict[Any, list] = {}  # process group -> [name, ranks, next seq]
        self._block: _Block | None = None
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._store_broken = False
        self._published: tuple[_Block, str] | None = None  # the block whose position is in the store
        self._store_owner: Any = None  # the default store itself: where this rank hosts it, the server
        self._last_read: dict[int, dict[str, Any] | None] = {}  # positions as the last report read them
        self._failed: tuple[dict[str, Any], tuple[int, ...]] | None = None  # our published failure, its peers
        self._rank: int | None = None
        self._lock = threading.Lock()  # the store connection is shared by this thread and the watchdog's

    # ------------------------------------------------------------ main thread (hot path)

    def issue(self, op: str, group: Any) -> Ticket:
        pg = dist.group.WORLD if group is None else group
        entry = self._groups.get(pg)
        if entry is None:
            name = "world" if pg is dist.group.WORLD else cast(dist.ProcessGroup, pg).group_name
            entry = self._groups[pg] = [name, tuple(dist.get_process_group_ranks(pg)), 0]
        seq = entry[2]
        entry[2] = seq + 1
        return Ticket(op, entry[0], entry[1], seq)

    @contextmanager
    def blocked(self, ticket: Ticket | None) -> Iterator[None]:
        """Mark the calling thread blocked in `ticket` (None: not a tracked collective)."""
        if ticket is None or len(ticket.ranks) == 1 or self._block is not None:
            yield
            return
        self._prepare()
        self._block = block = _Block(ticket, time.monotonic(), threading.get_ident())
        began = timeline.mark()  # [Note: timeline cost] in timeline.py
        try:
            yield
        except RuntimeError as error:
            # A store's own timeout belongs to the caller (a store exchange names its missing ranks).
            if isinstance(error, (CollectiveError, dist.DistStoreError)) or not _from_backend(error):
                raise
            raise self._failure(block, error) from error
        finally:
            self._block = None
            timeline.finish(began, "wait", ticket.op, "watchdog", group=ticket.group)

    # ------------------------------------------------------------ reporting

    def publish_after(self) -> float:
        return min(2.0, self.warning_s / 2)

    def reset(self) -> None:
        """Forget the old world's groups and store connection (a new world was made)."""
        with self._lock:
            self._groups, self._store, self._store_broken, self._published = {}, None, False, None
            self._store_owner, self._last_read, self._failed, self._rank = None, {}, None, None

    def _prepare(self) -> None:
        if self._store is None and not self._store_broken:
            # Connect now, while the store surely lives: connecting later to a store whose host
            # has died waits out the whole store timeout, twice.
            with self._lock:
                self._get_store()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="zerodist-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.publish_after()))
            try:
                self._look()
            except Exception as error:  # never let the watchdog kill or hang the process
                logger.debug("watchdog: %s", error)

    def _look(self) -> None:
        block = self._block
        if self._published is not None and self._published[0] is not block:
            # The block we published ended: say so, so that nobody is told we are still there.
            self._publish({"state": "left", "at": self._published[1]}, unless_failed=True)
            self._published = None
        if block is None:
            return
        waited = time.monotonic() - block.started
        if waited < self.publish_after():
            return
        if self._published is None:
            where = self._describe_block(block)
            self._published = (block, where)
            self._publish({"state": "blocked", "at": where, "op": block.ticket.op,
                           "group": block.ticket.group, "seq": block.ticket.seq}, unless_failed=True)
        if waited >= self.warning_s and time.monotonic() - block.warned_at >= REPEAT_S:
            block.warned_at = time.monotonic()
            logger.warning("%s", self.explain(block, waited))

    def _describe_block(self, block: _Block) -> str:
        frame = sys._current_frames().get(block.thread_id)
        return f"{block.ticket.describe()} at {call_site(frame)}"

    def explain(self, block: _Block, waited: float, positions: dict[int, dict[str, Any] | None] | None = None) -> str:
        """Whom this block waits for, and where they are (`positions`: as read from the store,
        read now when None)."""
        me = dist.get_rank()
        peers = [r for r in block.ticket.ranks if r != me]
        if positions is None:
            positions = self._read_positions(peers)
        ticket = block.ticket
        here = [r for r, p in positions.items()
                if p and p.get("state") == "blocked" and (p.get("op"), p.get("group"), p.get("seq")) ==
                (ticket.op, ticket.group, ticket.seq)]
        missing = [r for r in peers if r not in here]
        head = f"rank {me}: waiting {waited:.0f} s"
        where = self._describe_block(block)
        if not missing:
            return (f"{head} in {where}; every rank of the group is in it too "
                    "(a slow transfer or an overloaded host, not a missing rank)")
        # Peers that timed out in this very collective waited for this rank, not it for them (it was
        # stopped, SIGSTOP or a suspended host, or stalled past the timeout, and came late).
        if all(_timed_out_in(positions.get(r), ticket) for r in missing):
            lines = [f"rank {me}: late in {where}; rank(s) [{format_ranks(missing)}] reached it first, waited for this "
                     "rank until the collective timeout and left: this rank was the one missing (stopped or stalled), "
                     "not them"]
        else:
            lines = [f"{head} for rank(s) [{format_ranks(missing)}] at {where}"]
        for r in missing:
            lines.append(f"  rank {r} {_position_text(positions.get(r))}")
        return "\n".join(lines)

    def _failure(self, block: _Block, error: RuntimeError) -> CollectiveError:
        waited = time.monotonic() - block.started
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        # [Note: a lost connection after a peer's timeout] the peer that timed out first drops its
        # connections (gloo does at the timeout, before the peer's Python has said anything), and this
        # rank, blocked in the same stalled collective, finds its connection closed a moment before its
        # own timeout: the error it was about to get is the timeout, so it gets that. The peer's
        # report comes a moment after the lost connection (seconds on a loaded machine): wait for it.
        story, positions = self._failure_story(block, waited, 0.0 if timed_out else PEER_REPORT_WAIT_S)
        left_after_timeout = [r for r, p in positions.items() if p and p.get("state") == "failed"
                              and p.get("error") == "timed out" and r in block.ticket.ranks]
        try:
            self._record_failure(block, "timed out" if timed_out or left_after_timeout else str(error)[:200])
        except Exception as error_publishing:  # the store may be what died
            logger.debug("watchdog: could not publish the failure: %s", error_publishing)
        if timed_out or left_after_timeout:
            how_long = (f"({waited:.0f} s waited)" if timed_out else f"(rank(s) [{format_ranks(left_after_timeout)}] "
                        f"reached it and left; this rank waited {waited:.0f} s)")
            return CollectiveTimeoutError(
                f"{story}\n{block.ticket.describe()} did not complete within the collective timeout "
                f"{how_long}. Every rank must issue the same collectives in the same order; a rank "
                "that runs an extra step, skips a barrier or a save, or is stuck, looks like this. The timeout is "
                f"zerodist.timeout in the config or ZERODIST_TIMEOUT seconds ({DEFAULT_COLLECTIVE_TIMEOUT_S:g} s "
                f"by default). Backend: {error}", story=f"{story}\nBackend: {error}")
        return CollectiveError(f"{story}\n{block.ticket.describe()} failed after {waited:.0f} s: {error}. A peer's "
                               "connection closing means that rank exited or crashed: its own log says why.")

    def _failure_story(self, block: _Block, waited: float, settle_s: float) -> tuple[str, dict[int, dict[str, Any] | None]]:
        """Whom `block` waited for, from the store, else from the last report's reading of it (the
        rank hosting the store may be gone: a loaded machine delays this rank's reading). With
        `settle_s` > 0, waits that long at most for the peers to publish how they ended."""
        peers = [r for r in block.ticket.ranks if r != dist.get_rank()]
        try:
            positions = self._read_positions(peers)
            deadline = time.monotonic() + settle_s
            while not _all_ended(positions) and time.monotonic() < deadline:
                time.sleep(0.05)
                positions = self._read_positions(peers)
            return self.explain(block, waited, positions), positions
        except Exception as read_error:
            if peers and all(r in self._last_read for r in peers):
                positions = {r: self._last_read[r] for r in peers}
                story = self.explain(block, waited, positions)
                return (f"{story}\n  (the other ranks' positions as last read: the store could not be read now: "
                        f"{read_error})"), positions
            return (f"rank {dist.get_rank()}: blocked {waited:.0f} s in {self._describe_block(block)}; where the "
                    f"other ranks are is unknown: the store could not be read ({read_error})"), {}

    def _record_failure(self, block: _Block, error: str) -> None:
        position = {"state": "failed", "at": self._describe_block(block), "error": error, "op": block.ticket.op,
                    "group": block.ticket.group, "seq": block.ticket.seq}
        self._publish(position, failure_of=block.ticket.ranks)

    def publish_exit(self) -> None:
        """This process is leaving the world (its program ended): say so, so that a rank still
        waiting in a collective learns why its peer's connection closed. Only over a store
        connection made earlier (a dead store's host must not hold up the exit); never raises."""
        if self._store is None:
            return
        try:
            # A failure stays what the others read (they learn why this rank left), marked exited.
            self._publish({**self._failed[0], "exited": True} if self._failed else {"state": "exited"})
        except Exception as error:  # leaving anyway
            logger.debug("watchdog: could not publish the exit: %s", error)

    def linger_after_failure(self, limit_s: float = LINGER_S) -> None:
        """[Note: the failed rank lingers] A rank that failed in a collective exits, its connections
        close, and its peers, still blocked in that collective, fail too and read the store to say
        whom they waited for. Where this rank hosts the store (rank 0 does, without torchrun's agent),
        its exit would take the store, and with it that story, away from a peer that reads a moment
        late (a loaded machine). So (every failed rank alike: a few reads of the store, and only while a
        peer is blocked), after its process groups are gone, it waits until no peer of the failed
        collective is still blocked in a collective (each has published its own failure, or left),
        for at most `limit_s` seconds. A peer that is not in a collective (computing, frozen)
        is not waited for: it reads nothing soon. Only after a failure; never raises."""
        if self._failed is None or self._store is None:
            return
        peers = [r for r in self._failed[1] if r != self._rank]
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline:
                positions = self._read_positions(peers)
                if not any(p is not None and p.get("state") == "blocked" for p in positions.values()):
                    return
                time.sleep(0.05)
        except Exception as error:  # leaving anyway
            logger.debug("watchdog: stopped waiting for the peers' reports: %s", error)

    def release_store(self) -> None:
        """The world is gone: drop the store (and, where this rank hosts it, its server) until a
        new world is made (`reset()`); a collective issued meanwhile fails in the backend."""
        with self._lock:
            self._store_owner, self._store, self._store_broken = None, None, True

    def _publish(self, position: dict[str, Any], *, unless_failed: bool = False,
                 failure_of: tuple[int, ...] | None = None) -> None:
        """Write this rank's position. `unless_failed`: not over a failure (the watchdog thread's
        "left" would otherwise race the failure it follows); `failure_of`: `position` is this rank's
        failure in a collective of those ranks."""
        position["time"] = time.time()
        with self._lock:
            if unless_failed and self._failed is not None:
                return
            if failure_of is not None:
                self._failed = (position, failure_of)
            store = self._get_store()
            if store is not None:
                with self._store_failures():
                    store.set(_key(self._my_rank()), json.dumps(position))

    def position_of(self, rank: int) -> dict[str, Any] | None:
        """What `rank` last published (`state`: blocked / failed / exited / left, `op`, `at`, ...),
        read from the store now; None while it has published nothing (never blocked for long)."""
        return self._read_positions([rank])[rank]

    def _read_positions(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        found: dict[int, dict[str, Any] | None] = {}
        with self._lock:
            store = self._get_store()
            with self._store_failures():
                for r in ranks:
                    key = _key(r)
                    found[r] = json.loads(store.get(key)) if store is not None and store.check([key]) else None
            self._last_read.update(found)
        return found

    @contextmanager
    def _store_failures(self) -> Iterator[None]:
        """[Note: store dumps] Around a store operation (under `_lock`): c10d's TCPStore logs a failed
        socket operation (its host has exited) as a C++ warning with a 20-frame backtrace on stderr,
        below Python, before raising; at the exit of a successful run (`publish_exit` after the host
        rank left) and after a failure those dumps buried the named errors. stderr (fd 2) is caught
        in a file meanwhile and given back without them (anything else written by another thread in
        that moment comes out a moment later); and after one failure the connection is dropped, so
        that later reports neither wait on it nor fail again."""
        with _without_store_dumps():
            try:
                yield
            except dist.DistNetworkError:  # the connection is lost (a timeout keeps it)
                self._store, self._store_broken = None, True
                raise

    def _my_rank(self) -> int:
        """This rank, remembered: the lingering exit reads the store after its groups are destroyed."""
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def _get_store(self) -> Any:
        if self._store is None and not self._store_broken:
            try:
                # A connection of our own with a short timeout: a dead store must not hang the watchdog.
                store: Any = compat.default_store()  # Store.clone() is missing from torch's type stubs
                self._store_owner = store  # a clone does not keep the server up ([Note: the failed rank lingers])
                self._my_rank()
                self._store = store.clone()
                self._store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
            except (AttributeError, RuntimeError, ValueError) as error:  # ValueError: no default group
                self._store_broken = True
                logger.debug("hang watchdog: cannot clone the store (%s); it will not say where other ranks are",
                             error)
        return self._store


_DUMP_LINE = re.compile(r"^(\[rank\d+\]:)?\[[WE]\S* [\d:.]+ TCPStore\.cpp:\d+\] |^Exception raised from |^frame #\d+: "
                        r"|^<omitting python frames>$")


@contextmanager
def _without_store_dumps() -> Iterator[None]:
    """stderr (fd 2) caught in a file while the block runs, then written back without c10d's TCPStore
    warnings and their C++ backtraces ([Note: store dumps])."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = strip_store_dumps(caught.read().decode("utf-8", "replace"))
            if kept:
                os.write(2, kept.encode("utf-8"))


def strip_store_dumps(text: str) -> str:
    """`text` without c10d's TCPStore warning lines and the backtrace lines (and blank lines) after them."""
    kept, in_dump = [], False
    for line in text.splitlines(keepends=True):
        if _DUMP_LINE.match(line) or (in_dump and not line.strip()):
            in_dump = True
            continue
        in_dump = False
        kept.append(line)
    return "".join(kept)


def _timed_out_in(position: dict[str, Any] | None, ticket: Ticket) -> bool:
    """Whether `position` says its rank timed out in `ticket`'s collective (waiting for the others)."""
    p = position or {}
    return p.get("state") == "failed" and p.get("error") == "timed out" and (
        p.get("op"), p.get("group"), p.get("seq")) == (ticket.op, ticket.group, ticket.seq)


def _all_ended(positions: dict[int, dict[str, Any] | None]) -> bool:
    """Whether every rank's position says it failed or exited."""
    return all(p is not None and p.get("state") in ("failed", "exited") for p in positions.values())


def _key(rank: int) -> str:
    return f"zerodist/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _position_text(position: dict[str, Any] | None) -> str:
    if position is None:
        return ("has not been blocked in a collective for long (it is computing, frozen, or outside "
                "zerodist's collectives)")
    ago = time.time() - position.get("time", time.time())
    state = position.get("state")
    if state == "blocked":
        return f"is at {position['at']} (for {ago:.0f} s)"
    if state == "exited":
        return (f"exited {ago:.0f} s ago: its program ended while this rank still issues collectives (the ranks "
                "ran different numbers of steps: uneven batch counts per rank, or a loop that ends earlier on some)")
    if state == "failed":
        exited = " (it has exited since)" if position.get("exited") else ""
        return f"failed {ago:.0f} s ago in {position['at']}: {position.get('error')}{exited}"
    return f"left {position['at']} {ago:.0f} s ago and has not been blocked for long since"


def _from_backend(error: RuntimeError) -> bool:
    """gloo's timeouts and lost connections are plain RuntimeErrors from its C++ code."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo" in text or "Timed out" in text or "Connection" in text


def call_site(frame: Any) -> str:
    """The first frame outside zerodist/comm, and the first outside zerodist when different."""
    while frame is not None and (frame.f_code.co_filename.startswith(_COMM_DIR) or _is_plumbing(frame)):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    site = _frame_text(frame)
    if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        user = frame  # past zerodist's frames and torch's between them (Module.__call__ into a hook, ...)
        while user is not None and (user.f_code.co_filename.startswith(_PACKAGE_DIR) or _is_plumbing(user)):
            user = user.f_back
        if user is not None:
            site += f" <- {_frame_text(user)}"
    return site


def _is_plumbing(frame: Any) -> bool:
    """Frames between the blocked thread's caller and the backend: contextlib's and torch's own."""
    if frame is None:
        return False
    path = frame.f_code.co_filename
    return path.startswith(_TORCH_DIR) or path.endswith(f"{os.sep}contextlib.py")


_display_paths: dict[str, str] = {}


def _frame_text(frame: Any) -> str:
    path = frame.f_code.co_filename
    shown = _display_paths.get(path)
    if shown is None:
        try:
            relative = os.path.relpath(path)
            shown = relative if not relative.startswith("..") else path
        except ValueError:
            shown = path  # another drive on Windows
        _display_paths[path] = shown
    return f"{shown}:{frame.f_lineno} {frame.f_code.co_name}"


def seconds_from_env(name: str, default: float) -> float:
    """The environment variable `name` as a number of seconds, `default` when unset; a named
    error when it is not a number. The caller checks the range."""
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


def _warning_from_env() -> float:
    seconds = seconds_from_env(WARNING_ENV_VAR, DEFAULT_WARNING_S)
    if not seconds > 0:
        raise ValueError(f"{WARNING_ENV_VAR} must be > 0 seconds, got {seconds:g}")
    return seconds


watchdog = Watchdog()


def set_hang_warning(seconds: float) -> None:
    """Warn after a collective has blocked this long (seconds > 0); call on every rank."""
    if not seconds > 0:
        raise ValueError(f"the hang warning must be > 0 seconds, got {seconds}")
    watchdog.warning_s = float(seconds)
