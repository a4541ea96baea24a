"""The schedule log: the order in which tensor-parallel collectives are issued, waited on, and
interleaved with compute, from which the schedule-level overlap is measured.

    with schedule_log() as log:
        loss = model(idx, targets); loss.backward()
    log.overlap_fraction("forward")   # bytes whose issue-to-wait window contains compute / all bytes

Asynchronous tensor-parallel collectives (Domino's row-parallel reductions in forward, the
column-parallel input-gradient reductions in backward) are logged with their issue and wait;
synchronous ones (`sync` events: an empty window) only with their bytes, so `all_bytes(phase)` is
every tensor-parallel byte while `overlap_fraction(phase)` measures the asynchronous schedule
(`include_sync=True` counts the synchronous bytes as not overlapped). Payloads follow the
tracer's convention (the full tensor; the gathered output; the unreduced input). Like the
tracer, an inactive log costs one truthiness test of a module-level list.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass(frozen=True)
class ScheduleEvent:
    kind: str           # "issue", "wait", "compute" or "sync"
    collective: int     # the collective's id ("issue" / "wait"), -1 for compute
    phase: str          # "forward" or "backward"
    num_bytes: int = 0
    label: str = ""
    blocked_s: float = 0.0  # "wait": how long the wait blocked


class ScheduleLog:
    def __init__(self) -> None:
        self.events: list[ScheduleEvent] = []

    def windows(self, phase: str) -> list[tuple[int, int, int]]:
        """(bytes, compute events inside the window, issue index) per collective of `phase`."""
        open_at: dict[int, tuple[int, int]] = {}
        result = []
        computes = 0
        for event in self.events:
            if event.kind == "compute":
                computes += 1
            elif event.kind == "issue" and event.phase == phase:
                open_at[event.collective] = (computes, event.num_bytes)
            elif event.kind == "wait" and event.collective in open_at:
                start, num_bytes = open_at.pop(event.collective)
                result.append((num_bytes, computes - start, event.collective))
        if open_at:
            raise AssertionError(f"collectives {sorted(open_at)} were issued but never waited on")
        return result

    def overlap_fraction(self, phase: str, *, include_sync: bool = False) -> float:
        """Fraction of `phase`'s asynchronous bytes (all bytes with `include_sync`) whose
        issue-to-wait window contains compute."""
        windows = self.windows(phase)
        total = self.all_bytes(phase) if include_sync else sum(b for b, _, _ in windows)
        return sum(b for b, computes, _ in windows if computes) / total if total else 0.0

    def total_bytes(self, phase: str) -> int:
        """Bytes of `phase`'s asynchronous collectives."""
        return sum(b for b, _, _ in self.windows(phase))

    def blocked_seconds(self, phase: str) -> float:
        """Time spent blocked in waits for `phase`'s asynchronous collectives (time-level overlap:
        compare with the same collectives run alone)."""
        return sum(e.blocked_s for e in self.events if e.kind == "wait" and e.phase == phase)

    def issued_sizes(self, phase: str) -> list[int]:
        """Bytes of each asynchronous collective of `phase`, in issue order."""
        return [e.num_bytes for e in self.events if e.kind == "issue" and e.phase == phase]

    def all_bytes(self, phase: str) -> int:
        """Bytes of every tensor-parallel collective of `phase`."""
        return sum(e.num_bytes for e in self.events if e.phase == phase and e.kind in ("issue", "sync"))


active_logs: list[ScheduleLog] = []
_ids = itertools.count()


@contextmanager
def schedule_log() -> Iterator[ScheduleLog]:
    log = ScheduleLog()
    active_logs.append(log)
    try:
        yield log
    finally:
        active_logs.remove(log)


def log_issue(phase: str, num_bytes: int) -> int:
    """Record an asynchronous collective's issue; returns its id for `wait` (-1 when off)."""
    if not active_logs:
        return -1
    collective = next(_ids)
    for log in active_logs:
        log.events.append(ScheduleEvent("issue", collective, phase, num_bytes))
    return collective


def log_sync(phase: str, num_bytes: int) -> None:
    for log in active_logs:
        log.events.append(ScheduleEvent("sync", -1, phase, num_bytes))


def wait(handle: object, collective: int, phase: str) -> None:
    """`handle.wait()`, logged with the time it blocked when `collective` was logged."""
    if collective < 0:
        handle.wait()  # type: ignore[attr-defined]
        return
    started = time.perf_counter()
    handle.wait()  # type: ignore[attr-defined]
    blocked = time.perf_counter() - started
    for log in active_logs:
        log.events.append(ScheduleEvent("wait", collective, phase, blocked_s=blocked))


def log_compute(phase: str, label: str) -> None:
    for log in active_logs:
        log.events.append(ScheduleEvent("compute", -1, phase, label=label))
