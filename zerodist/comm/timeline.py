"""The step timeline's recorder: spans of compute, collectives, messages and swap I/O on this rank.

    recorder = timeline.start()             # every hook below records into it until stop()
    with timeline.span("compute", "forward"):
        ...
    timeline.stop()
    recorder.spans, recorder.collectives    # zerodist/debug/timeline.py merges and analyses them

It lives in comm/ (layer 3) so that the techniques (pipe/, zero/, offload/, layer 5) can record
their spans without knowing about the debug layer that merges and draws them.

[Note: timeline cost] Every hook first tests the module-level `recording` flag; when no recorder
is active that is the whole cost (a global load and a branch: tens of nanoseconds against a
collective's tens of microseconds). While recording, a collective costs two clock reads, one
small object and, for an async one, a completion callback on its future.

[Note: timeline clock] Spans are stamped with `time.perf_counter_ns()` (monotonic, fine-grained)
and carry the recorder's `wall_offset_ns` (the wall clock minus the perf counter, read once at
start) so that each rank's spans land on its wall clock; the debug layer then removes the ranks'
wall clock differences with one all-gather of the wall clock taken just after a barrier
(`debug.timeline.align_clocks`), so the merged trace puts every rank on rank 0's clock within the
barrier's exit skew (tens of microseconds on one machine).

A collective is recorded with: when it was issued (the call into torch.distributed, `issue`),
the time the calling thread blocked in it (the whole call for a synchronous one, the `wait()`
for an async one), and when it completed (the work's future callback, which runs on the backend's
thread; where a work has no future, the end of its wait, or the wait's start when it was already
complete). Overlap is measured from these in zerodist/debug/timeline.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.autograd.profiler import record_function

from zerodist import compat

# [Note: timeline cost] the one test every hook makes; True only between start() and stop()
recording = False

_NULL = nullcontext()


@dataclasses.dataclass
class Span:
    """One interval on one track of this rank. `cat`: compute, pipe, swap, p2p, step, ..."""

    cat: str
    name: str
    start_ns: int
    end_ns: int
    track: str = "main"
    args: dict[str, Any] | None = None


@dataclasses.dataclass
class CollectiveSpan:
    """One collective as this rank issued it ([Note: timeline clock] for the times)."""

    op: str
    num_bytes: int
    group: str
    group_size: int
    seq: int
    issue_ns: int
    issued_ns: int                       # when the launching call returned
    blocked: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # the thread waiting in it
    done_ns: int | None = None
    async_op: bool = False

    @property
    def end_ns(self) -> int:
        ends = [self.issued_ns, *(end for _, end in self.blocked)]
        return self.done_ns if self.done_ns is not None else max(ends)


@dataclasses.dataclass
class Recorder:
    """What one rank recorded between `start()` and `stop()`."""

    rank: int
    wall_offset_ns: int                  # wall clock minus perf counter at start ([Note: timeline clock])
    start_ns: int
    spans: list[Span] = dataclasses.field(default_factory=list)
    collectives: list[CollectiveSpan] = dataclasses.field(default_factory=list)
    end_ns: int = 0


_current: Recorder | None = None


def now() -> int:
    return time.perf_counter_ns()


def start(rank: int = 0) -> Recorder:
    """Begin recording on this rank; every hook records into the returned recorder until `stop()`."""
    global recording, _current
    if _current is not None:
        raise RuntimeError("a timeline is already recording on this rank; stop() it before starting another")
    perf, wall = time.perf_counter_ns(), time.time_ns()
    _current = Recorder(rank=rank, wall_offset_ns=wall - perf, start_ns=perf)
    recording = True
    return _current


def stop() -> Recorder | None:
    """Stop recording; returns the recorder (None when none was recording)."""
    global recording, _current
    recorder, _current, recording = _current, None, False
    if recorder is not None:
        recorder.end_ns = now()
    return recorder


def current() -> Recorder | None:
    return _current


def add(cat: str, name: str, start_ns: int, end_ns: int, track: str = "main", args: dict[str, Any] | None = None) -> None:
    recorder = _current
    if recorder is not None:
        recorder.spans.append(Span(cat, name, start_ns, end_ns, track, args))


@contextmanager
def _span(cat: str, name: str, track: str, args: dict[str, Any] | None) -> Iterator[None]:
    begin = now()
    try:
        if compat.profiler_enabled():  # the same span in torch.profiler's trace (HTA reads those)
            with record_function(f"zerodist::{name}"):
                yield
        else:
            yield
    finally:
        add(cat, name, begin, now(), track, args)


def span(cat: str, name: str, track: str = "main", **args: Any) -> Any:
    """A context manager recording the block as one span; a shared no-op when not recording."""
    if not recording:
        return _NULL
    return _span(cat, name, track, args or None)


def mark() -> int:
    """A start time for `finish`, or 0 when not recording (then `finish` does nothing)."""
    return now() if recording else 0


def finish(begin: int, cat: str, name: str, track: str = "main", **args: Any) -> None:
    """Record [begin, now] as a span when `begin` came from `mark()` while recording."""
    if begin and recording:
        add(cat, name, begin, now(), track, args or None)


def pipe_action(kind: str, stage: int, microbatch: int) -> Any:
    """A pipeline executor's action as a span (cat "pipe"); a no-op when not recording."""
    if not recording:
        return _NULL
    return _span("pipe", f"{kind}{microbatch}", "main", {"kind": kind, "stage": stage, "microbatch": microbatch})


def p2p_message(op: str, tensor: torch.Tensor) -> None:
    """One tensor of a point-to-point message as the tracer counts it (send, recv, p2p_header): an
    instant on the p2p track (the pipeline's SEND / RECV action spans carry the time it took)."""
    if recording:
        moment = now()
        add("p2p", op, moment, moment, "p2p", {"bytes": tensor.numel() * tensor.element_size()})


def collective(op: str, tensor: torch.Tensor | None, numel: int, ticket: Any,
               launch: Callable[[bool], Any]) -> Callable[[bool], Any]:
    """`launch` (a collective's call into torch.distributed), recording the collective when called."""
    recorder = _current
    if recorder is None:
        return launch
    num_bytes = 0 if tensor is None else numel * tensor.element_size()
    group, ranks, seq = (ticket.group, len(ticket.ranks), ticket.seq) if ticket is not None else ("?", 0, 0)

    def recorded(async_op: bool) -> Any:
        begin = now()
        work = launch(async_op)
        issued = now()
        entry = CollectiveSpan(op, num_bytes, group, ranks, seq, begin, issued, async_op=work is not None)
        recorder.collectives.append(entry)
        if work is None:  # synchronous: the thread blocked for the whole call
            entry.blocked.append((begin, issued))
            entry.done_ns = issued
            return work
        _on_completion(work, entry)
        return _RecordedWork(work, entry)

    return recorded


def _on_completion(work: Any, entry: CollectiveSpan) -> None:
    """Stamp `entry.done_ns` when `work` completes: its future's callback, or for several works waited
    as one (gloo's all-gather by broadcasts: a `works` list) when the last of theirs runs."""
    futures = []
    for part in getattr(work, "works", None) or [work]:
        get_future = getattr(part, "get_future", None)
        if get_future is None:
            return
        try:
            futures.append(get_future())
        except RuntimeError:  # a backend without futures for this op
            return

    def done(_: Any) -> None:  # runs on the backend's threads; the last to finish stamps the time
        if entry.done_ns is None and all(future.done() for future in futures):
            entry.done_ns = now()

    for future in futures:
        future.add_done_callback(done)


class _RecordedWork:
    """An async collective's work whose `wait()` is recorded as blocked time."""

    __slots__ = ("work", "entry")

    def __init__(self, work: Any, entry: CollectiveSpan):
        self.work, self.entry = work, entry

    def wait(self, *args: Any) -> Any:
        already = self.work.is_completed()
        begin = now()
        try:
            return self.work.wait(*args)
        finally:
            end = now()
            self.entry.blocked.append((begin, end))
            if self.entry.done_ns is None:
                self.entry.done_ns = begin if already else end

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)
