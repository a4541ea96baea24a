"""The communication tracer: what each collective moved, and how fast.

    with zerodist.comm.trace(timing=True) as t:
        train_step()
    print(t.format_summary())

Every collective issued through `zerodist.comm` is recorded while a trace is active. When no
trace is active the cost is one truthiness check of a module-level list per collective.

[Note: bandwidth conventions] We follow nccl-tests (PERFORMANCE.md there):
- `size` is the full logical buffer: the tensor for all_reduce / broadcast / reduce, the
  *gathered* output for all_gather, the *unreduced* input for reduce_scatter, the input for
  all_to_all.
- algorithm bandwidth `algbw = size / time`.
- bus bandwidth `busbw = algbw * factor`, the factor making it comparable with link speed:
  all_reduce 2(n-1)/n; reduce_scatter, all_gather and all_to_all (n-1)/n; broadcast and reduce 1.
- "bus elements" = numel * factor is what one rank sends in a bandwidth-optimal algorithm;
  it is the quantity the ZeRO communication formulas of docs/design/zero.md count (2Ψ(n-1)/n for stages 0-2).
DeepSpeed's comms logger reports all_reduce "throughput" as 2S/t (factor 2 instead of
2(n-1)/n), which overstates bus bandwidth by n/(n-1): 2x on two ranks.

[Note: blocked time] `measure_blocked()` accumulates the wall time the calling thread spends
blocked in zerodist's collectives: inside every synchronous collective and inside
`CommHandle.wait()`. That is the communication a step did *not* overlap with its compute (an
async collective that finished before its wait costs almost nothing). It is separate from the
tracer so that it can stay on for a whole benchmark without forcing async collectives to wait
where they are issued (as `trace(timing=True)` does); when no meter is active the cost is one
truthiness check per collective and per wait. On CUDA, `wait()` only orders streams, so the meter
sees the CPU side of a wait, not the device's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from zerodist.utils import format_bytes, get_logger

logger = get_logger(__name__)

_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for `op` over `group_size` ranks (0 for ops that move no tensor)."""
    factor = _BUS_FACTORS.get(op)
    return factor(group_size) if factor is not None else 0.0


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued on this rank."""

    op: str
    dtype: torch.dtype | None
    numel: int
    num_bytes: int
    group_size: int
    duration_s: float | None = None
    label: str | None = None
    link: str | None = None  # "intra" / "inter" ([Note: link classes] in nodes.py); None: not known

    @property
    def bus_elements(self) -> float:
        return self.numel * bus_factor(self.op, self.group_size)

    @property
    def bus_bytes(self) -> float:
        return self.num_bytes * bus_factor(self.op, self.group_size)


@dataclasses.dataclass(frozen=True)
class OpSummary:
    """Totals of one op within a trace. Bandwidths are None unless the trace was timed."""

    op: str
    count: int
    numel: int
    num_bytes: int
    bus_bytes: float
    time_s: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None


class Trace:
    """Records collectives between `__enter__` and `__exit__` (use `trace()`)."""

    def __init__(self, *, timing: bool = False, ops: Iterable[str] | None = None, verbose: bool = False,
                 keep_records: bool = True):
        self.timing = timing
        self.ops = frozenset(ops) if ops else None
        self.verbose = verbose
        # keep_records=False: only per-op totals, in constant memory, for a trace around a whole
        # run (a record per collective grew a long run's memory step after step).
        self.keep_records = keep_records
        self.records: list[CollectiveRecord] = []
        self._totals: dict[str, _OpTotals] = {}
        self._links: dict[str, _OpTotals] = {}  # the same totals per link class (intra / inter)
        self._labelled: dict[tuple[str, str], _OpTotals] = {}  # per (label, op), for labelled records only

    def wants(self, op: str) -> bool:
        return self.ops is None or op in self.ops

    def add(self, record: CollectiveRecord) -> None:
        if self.keep_records:
            self.records.append(record)
        totals = self._totals.get(record.op)
        if totals is None:
            totals = self._totals[record.op] = _OpTotals()
        totals.add(record)
        if record.link is not None:
            by_link = self._links.get(record.link)
            if by_link is None:
                by_link = self._links[record.link] = _OpTotals()
            by_link.add(record)
        if record.label is not None:
            key = (record.label, record.op)
            by_label = self._labelled.get(key)
            if by_label is None:
                by_label = self._labelled[key] = _OpTotals()
            by_label.add(record)
        if self.verbose:
            logger.info(
                "%s %s x%d (%s) group=%d%s", record.op, record.dtype, record.numel,
                format_bytes(record.num_bytes), record.group_size,
                "" if record.duration_s is None else f" {record.duration_s * 1e3:.3f} ms",
            )

    def _selected(self, op: str | None) -> list[_OpTotals]:
        return [t for name, t in self._totals.items() if op is None or name == op]

    def count(self, op: str | None = None) -> int:
        return sum(t.count for t in self._selected(op))

    def total_bytes(self, op: str | None = None) -> int:
        return sum(t.num_bytes for t in self._selected(op))

    def total_numel(self, op: str | None = None) -> int:
        return sum(t.numel for t in self._selected(op))

    def bus_elements(self, op: str | None = None) -> float:
        """Elements this rank sends under nccl-tests' convention (see [Note: bandwidth conventions])."""
        return sum(t.bus_elements for t in self._selected(op))

    def bus_bytes(self, op: str | None = None) -> float:
        return sum(t.bus_bytes for t in self._selected(op))

    def labelled_bytes(self, label: str, op: str | None = None) -> int:
        """Bytes of the records labelled `label` (a `labelled()` block's, or a p2p message's axis)."""
        return sum(t.num_bytes for (name, kind), t in self._labelled.items() if name == label and op in (None, kind))

    def labelled_bus_bytes(self, label: str, op: str | None = None) -> float:
        """Bus bytes of the collectives issued under `labelled(label)` (of `op` only, if given)."""
        return sum(t.bus_bytes for (name, kind), t in self._labelled.items() if name == label and op in (None, kind))

    def bytes_by_link(self) -> dict[str, int]:
        """Bytes of the logical buffers (the sizes of [Note: bandwidth conventions]) per link class:
        `{"intra": ..., "inter": ...}` ([Note: link classes] in nodes.py)."""
        return {link: self._links[link].num_bytes if link in self._links else 0 for link in ("intra", "inter")}

    def bus_bytes_by_link(self) -> dict[str, float]:
        """Bytes this rank sends (bus bytes) per link class: `{"intra": ..., "inter": ...}`."""
        return {link: self._links[link].bus_bytes if link in self._links else 0.0 for link in ("intra", "inter")}

    def summary(self) -> dict[str, OpSummary]:
        """Per-op totals, in first-seen order."""
        return {op: totals.summary(op) for op, totals in self._totals.items()}

    def format_summary(self) -> str:
        header = f"{'op':<18}{'count':>7}{'bytes':>13}{'bus bytes':>13}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"
        lines = [header]
        for s in self.summary().values():
            ms = "-" if s.time_s is None else f"{s.time_s * 1e3:.2f}"
            alg = "-" if s.algbw_gbps is None else f"{s.algbw_gbps:.3f}"
            bus = "-" if s.busbw_gbps is None else f"{s.busbw_gbps:.3f}"
            lines.append(
                f"{s.op:<18}{s.count:>7}{format_bytes(s.num_bytes):>13}"
                f"{format_bytes(s.bus_bytes):>13}{ms:>10}{alg:>12}{bus:>12}"
            )
        if self._links:
            sent = self.bus_bytes_by_link()
            lines.append("bus bytes by link: " + ", ".join(f"{link} {format_bytes(v)}" for link, v in sent.items()))
        return "\n".join(lines)


@dataclasses.dataclass
class _OpTotals:
    """One op's running totals within a trace."""

    count: int = 0
    numel: int = 0
    num_bytes: int = 0
    bus_bytes: float = 0.0
    bus_elements: float = 0.0
    time_s: float | None = 0.0  # None once any record was untimed

    def add(self, record: CollectiveRecord) -> None:
        self.count += 1
        self.numel += record.numel
        self.num_bytes += record.num_bytes
        self.bus_bytes += record.bus_bytes
        self.bus_elements += record.bus_elements
        self.time_s = None if self.time_s is None or record.duration_s is None else self.time_s + record.duration_s

    def summary(self, op: str) -> OpSummary:
        algbw = self.num_bytes / self.time_s / 1e9 if self.time_s else None
        busbw = self.bus_bytes / self.time_s / 1e9 if self.time_s else None
        return OpSummary(op, self.count, self.numel, self.num_bytes, self.bus_bytes, self.time_s, algbw, busbw)


# Traces currently recording, innermost last. Collectives test this list's truthiness only.
active_traces: list[Trace] = []


@contextmanager
def trace(*, timing: bool = False, ops: Iterable[str] | None = None, verbose: bool = False,
          keep_records: bool = True) -> Iterator[Trace]:
    """Record every collective issued through zerodist in this block.

    `timing=True` measures each collective's duration, which makes async collectives wait
    where they are issued: use it to measure, not while overlapping. `ops` restricts recording
    to those op names; `verbose` logs each record as it happens.
    """
    current = Trace(timing=timing, ops=ops, verbose=verbose, keep_records=keep_records)
    active_traces.append(current)
    try:
        yield current
    finally:
        active_traces.remove(current)


def timing_requested() -> bool:
    return any(t.timing for t in active_traces)


# Labels of the enclosing `labelled()` blocks, innermost last: what the collectives issued there are for.
_labels: list[str] = []


@contextmanager
def labelled(label: str) -> Iterator[None]:
    """Collectives issued in this block carry `label` in a trace (`CollectiveRecord.label`,
    `Trace.labelled_bus_bytes`), so a report can tell them from the same op issued for something else
    (qgZ's all-to-alls from Ulysses')."""
    _labels.append(label)
    try:
        yield
    finally:
        _labels.pop()


def record(op: str, tensor: torch.Tensor | None, numel: int, group_size: int, duration_s: float | None,
           link: str | None = None, label: str | None = None) -> None:
    """`label`: the axis a point-to-point message belongs to (`comm.p2p`: "pipe" for a stage's
    messages, "sequence" for the ring's blocks), so a trace under both can tell them apart; without
    one, the innermost enclosing `labelled()` block's label, if any."""
    dtype = None if tensor is None else tensor.dtype
    num_bytes = 0 if tensor is None else numel * tensor.element_size()
    if label is None and _labels:
        label = _labels[-1]
    entry = CollectiveRecord(op, dtype, numel, num_bytes, group_size, duration_s, link=link, label=label)
    for current in active_traces:
        if current.wants(op):
            current.add(entry)


def now() -> float:
    return time.perf_counter()


@dataclasses.dataclass(eq=False)  # identity: nested meters with equal totals are distinct
class BlockedTime:
    """What one `measure_blocked()` block accumulated ([Note: blocked time])."""

    seconds: float = 0.0
    num_blocking_calls: int = 0  # synchronous collectives plus waits on pending ones


# Meters currently accumulating. Collectives and waits test this list's truthiness only.
blocked_meters: list[BlockedTime] = []


@contextmanager
def measure_blocked() -> Iterator[BlockedTime]:
    """Accumulate the time this thread blocks in zerodist's collectives within the block."""
    meter = BlockedTime()
    blocked_meters.append(meter)
    try:
        yield meter
    finally:
        blocked_meters.remove(meter)


def add_blocked(seconds: float) -> None:
    for meter in blocked_meters:
        meter.seconds += seconds
        meter.num_blocking_calls += 1
