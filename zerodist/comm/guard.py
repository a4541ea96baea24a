"""The collective desync guard: every rank checks that every other rank issues the same collective.

A collective that one rank skips, or calls with another shape, does not fail in torch: the
ranks hang until the backend's timeout (30 minutes by default), or worse, a same-sized buffer
is silently reduced with the wrong one. With the guard on, before each collective every rank
writes a fingerprint (sequence number within the group, op, dtype, shape, call site) into the
process group's key-value store and reads every other rank's fingerprint for the same sequence
number. A difference, or a rank that does not arrive within `timeout_s`, raises
`CollectiveMismatchError` on every rank that checks, naming the ranks, shapes and call sites,
before the collective is issued, so nothing hangs.

    ZERODIST_COLLECTIVE_GUARD=1 zerodist run --nproc 4 train.py      # any program
    enable_collective_guard(timeout_s=10)  /  disable_collective_guard()
    with collective_guard(): ...

Off, it costs nothing: the hook is not in `pre_collective_hooks`. On, it costs a few store
round trips per collective (measured in docs/debugging.md) and makes the ranks' host threads
meet at every collective, so use it to debug, not to train fast.

[Note: guard keys] A fingerprint lives at `zerodist/guard/<session>/<group>/<seq>/<rank>`.
A rank writes seq s only after it has read every fingerprint of seq s-1, so once a rank has
read everyone's seq s, nobody will read its seq s-1 again: it deletes that key then. The store
thus holds at most two keys per rank and group. Each `enable` starts a new session (counted on
every rank alike), so keys left behind by an earlier, failed session are never read again.
A rank that gives up waiting overwrites its fingerprint with an abort note, so a late rank
that arrives afterwards fails too instead of entering a collective nobody else will join.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist

from zerodist import compat
from zerodist.comm.collectives import Group, pre_collective_hooks
from zerodist.comm.watchdog import call_site as frame_call_site
from zerodist.comm.watchdog import seconds_from_env
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

ENV_VAR = "ZERODIST_COLLECTIVE_GUARD"
TIMEOUT_ENV_VAR = "ZERODIST_COLLECTIVE_GUARD_TIMEOUT"
DEFAULT_TIMEOUT_S = 5.0

# Ops whose tensor has the same shape on every rank. all_to_all's output may legitimately
# differ in its first dim (uneven splits), so only its trailing dims are compared.
_SAME_SHAPE_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"})
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class CollectiveMismatchError(RuntimeError):
    """Ranks are about to issue different collectives (or one never arrived): a desync."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to issue. `aborted` is set when that rank gave up waiting."""

    seq: int
    op: str
    dtype: str | None
    shape: tuple[int, ...] | None
    call_site: str
    aborted: str | None = None

    def agreement_key(self) -> tuple:
        """The part every rank must agree on (call sites may differ legitimately)."""
        shape = self.shape
        if shape is not None and self.op not in _SAME_SHAPE_OPS:
            shape = shape[1:]
        return (self.op, self.dtype, shape)

    def encode(self) -> str:
        return json.dumps([self.seq, self.op, self.dtype, self.shape, self.call_site, self.aborted])

    @classmethod
    def decode(cls, raw: bytes | str) -> Fingerprint:
        seq, op, dtype, shape, site, aborted = json.loads(raw)
        return cls(seq, op, dtype, None if shape is None else tuple(shape), site, aborted)

    def describe(self) -> str:
        shape = "no tensor" if self.shape is None else f"{self.dtype} shape {self.shape}"
        return f"#{self.seq} {self.op} {shape} at {self.call_site}"


@dataclasses.dataclass
class _GroupState:
    """One process group as the guard sees it: its name, members and next sequence number."""

    name: str
    ranks: list[int]
    rank: int
    seq: int = 0


def format_ranks(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `'0-2, 5'`."""
    if not ranks:
        return "none"
    parts: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r  # type: ignore[assignment]  # the None sentinel ends the loop
    return ", ".join(parts)


def call_site() -> str:
    """The first frame outside zerodist/comm, and the first outside zerodist when different."""
    return frame_call_site(sys._getframe(1))


class CollectiveGuard:
    """One enabled guard session: the hook registered in `pre_collective_hooks`."""

    def __init__(self, timeout_s: float, session: int):
        self.timeout_s = timeout_s
        self.session = session
        self._groups: dict[Any, _GroupState] = {}
        self._store: Any = None
        self._store_waits = False  # True when the store could not be cloned with our timeout
        self._announced = False

    def __call__(self, op: str, tensor: torch.Tensor | None, group: Group) -> None:
        if not self._announced:  # the first guarded collective, when the world exists
            self._announced = True
            log_rank0(logger, "collective guard on (timeout %g s): every collective is checked across ranks",
                      self.timeout_s)
        state = self._group_state(group)
        if len(state.ranks) == 1:
            return
        seq = state.seq
        state.seq += 1
        mine = Fingerprint(
            seq, op, None if tensor is None else str(tensor.dtype).removeprefix("torch."),
            None if tensor is None else tuple(tensor.shape), call_site(),
        )
        store = self._get_store()
        store.set(self.key(state, seq, state.rank), mine.encode())
        peers = [r for r in state.ranks if r != state.rank]
        try:
            if self._store_waits:
                store.wait([self.key(state, seq, r) for r in peers], datetime.timedelta(seconds=self.timeout_s))
            raw = store.multi_get([self.key(state, seq, r) for r in peers])
        except dist.DistStoreError:
            raise self._timeout_error(state, mine, peers) from None
        fingerprints = {r: Fingerprint.decode(v) for r, v in zip(peers, raw)}
        fingerprints[state.rank] = mine
        _check_agreement(state, fingerprints)
        if seq > 0:
            store.delete_key(self.key(state, seq - 1, state.rank))

    def key(self, state: _GroupState, seq: int, rank: int) -> str:
        return f"zerodist/guard/{self.session}/{state.name}/{seq}/{rank}"

    def group_state(self, group: Group = None) -> _GroupState:
        """This rank's view of `group` (for tests and reports)."""
        return self._group_state(group)

    def _group_state(self, group: Group) -> _GroupState:
        # `None` and `dist.group.WORLD` are one group with one sequence of collectives: counted
        # apart, one rank's `group=None` call and another's `group=WORLD` call got different
        # numbers under the same key name, and correct runs failed as desynced.
        pg = cast(dist.ProcessGroup, dist.group.WORLD if group is None else group)  # initialised by now
        state = self._groups.get(pg)
        if state is None:
            ranks = dist.get_process_group_ranks(pg)
            name = "world" if pg is dist.group.WORLD else pg.group_name  # torch names the same group alike on every rank
            state = self._groups[pg] = _GroupState(name, ranks, dist.get_rank())
        return state

    def _get_store(self) -> Any:
        if self._store is None:
            store = compat.default_store()
            try:
                # A private connection, so our short timeout leaves the group's own alone.
                self._store = store.clone()
                self._store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
            except (AttributeError, RuntimeError):
                self._store, self._store_waits = store, True
        return self._store

    def _timeout_error(self, state: _GroupState, mine: Fingerprint, peers: list[int]) -> CollectiveMismatchError:
        store = self._store
        note = f"rank {state.rank} gave up waiting after {self.timeout_s:g} s"
        # Late ranks that read this instead of our fingerprint fail too (see [Note: guard keys]).
        store.set(self.key(state, mine.seq, state.rank), dataclasses.replace(mine, aborted=note).encode())
        missing = [r for r in peers if not store.check([self.key(state, mine.seq, r)])]
        lines = [
            f"collective {mine.describe()} on rank {state.rank}: rank(s) {format_ranks(missing or peers)} of group "
            f"'{state.name}' (ranks {format_ranks(state.ranks)}) did not reach collective #{mine.seq} within "
            f"{self.timeout_s:g} s."
        ]
        for r in missing:
            previous = self._read(state, mine.seq - 1, r) if mine.seq > 0 else None
            lines.append(f"  rank {r}: last checked collective " + (previous.describe() if previous else "none"))
        lines.append(
            "A rank that skipped this collective, stopped issuing collectives, or is stuck (a hang, slow I/O, "
            f"an exception) looks like this. If a rank is legitimately slower, raise the bound with "
            f"{TIMEOUT_ENV_VAR} or enable_collective_guard(timeout_s=...)."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _read(self, state: _GroupState, seq: int, rank: int) -> Fingerprint | None:
        key = self.key(state, seq, rank)
        try:
            return Fingerprint.decode(self._store.get(key)) if self._store.check([key]) else None
        except dist.DistStoreError:
            return None  # deleted between check and get


def _check_agreement(state: _GroupState, fingerprints: dict[int, Fingerprint]) -> None:
    mine = fingerprints[state.rank]
    aborted = {r: f for r, f in fingerprints.items() if f.aborted and r != state.rank}
    if aborted:
        notes = "; ".join(f"{f.aborted} (it was at {f.describe()})" for f in aborted.values())
        raise CollectiveMismatchError(
            f"collective {mine.describe()} on rank {state.rank} arrived after the others gave up: {notes}. "
            f"This rank is late by more than the guard's timeout, or skipped collectives before this one."
        )
    classes: dict[tuple, list[int]] = {}
    for r, f in sorted(fingerprints.items()):
        classes.setdefault(f.agreement_key(), []).append(r)
    if len(classes) == 1:
        return
    raise CollectiveMismatchError(_mismatch_message(state, mine.seq, fingerprints, list(classes.values())))


def _mismatch_message(state: _GroupState, seq: int, fingerprints: dict[int, Fingerprint], classes: list[list[int]]) -> str:
    sizes = sorted((len(c) for c in classes), reverse=True)
    lines = [
        f"collective #{seq} on group '{state.name}' (ranks {format_ranks(state.ranks)}) differs across ranks "
        f"(seen from rank {state.rank}):"
    ]
    by_text: dict[str, list[int]] = {}
    for r, f in sorted(fingerprints.items()):
        by_text.setdefault(f.describe(), []).append(r)
    for text, ranks in by_text.items():
        lines.append(f"  {'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}: {text}")
    if sizes[0] > sizes[1]:
        majority = max(classes, key=len)
        diverging = sorted(r for c in classes if c is not majority for r in c)
        lines.append(f"diverging rank(s): {format_ranks(diverging)} (ranks {format_ranks(majority)} agree)")
    else:
        lines.append("diverging rank(s): no majority; " + " vs ".join(format_ranks(c) for c in classes))
    lines.append(
        "Every rank must issue the same collectives in the same order with the same dtype and shape; "
        "a rank that skipped or added a collective shows a different op here."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- enabling

_active: CollectiveGuard | None = None
_sessions = 0  # guard sessions started by this process; equal on every rank (see [Note: guard keys])


def resolve_guard_timeout(timeout_s: float | None = None) -> float:
    """The argument, else `ZERODIST_COLLECTIVE_GUARD_TIMEOUT`, else 5 s."""
    if timeout_s is None:
        timeout_s = seconds_from_env(TIMEOUT_ENV_VAR, DEFAULT_TIMEOUT_S)
    if not timeout_s > 0:
        raise ValueError(f"collective guard timeout must be > 0 seconds, got {timeout_s}")
    return float(timeout_s)


def guard_requested(environ: dict[str, str] | None = None) -> bool:
    """Whether `ZERODIST_COLLECTIVE_GUARD` asks for the guard (1/true/yes/on; 0/false/no/off/unset)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={raw!r}: use 1 to turn the collective guard on, 0 or unset for off")


def enable_collective_guard(timeout_s: float | None = None) -> CollectiveGuard:
    """Check every following collective across ranks. Call it on every rank at the same point.

    Already on: only the timeout changes. Returns the active guard.
    """
    global _active, _sessions
    timeout = resolve_guard_timeout(timeout_s)
    if _active is not None:
        _active.timeout_s = timeout
        if _active._store is not None and not _active._store_waits:
            _active._store.set_timeout(datetime.timedelta(seconds=timeout))
        return _active
    _active = CollectiveGuard(timeout, _sessions)
    _sessions += 1
    pre_collective_hooks.append(_active)
    return _active


def disable_collective_guard() -> None:
    """Stop checking; collectives cost nothing extra again. Call it on every rank."""
    global _active
    if _active is None:
        return
    if _active in pre_collective_hooks:
        pre_collective_hooks.remove(_active)
    _active = None


def active_guard() -> CollectiveGuard | None:
    """The guard now checking collectives, or None when off."""
    return _active


@contextmanager
def collective_guard(timeout_s: float | None = None) -> Iterator[CollectiveGuard]:
    """Guard the collectives in this block (restoring the previous state after it)."""
    previous = _active.timeout_s if _active is not None else None
    guard = enable_collective_guard(timeout_s)
    try:
        yield guard
    finally:
        if previous is None:
            disable_collective_guard()
        else:
            enable_collective_guard(previous)


if guard_requested():
    enable_collective_guard()
