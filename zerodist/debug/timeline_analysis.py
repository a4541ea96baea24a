"""The step timeline's arithmetic: merged Chrome trace, overlap per kind, the pipeline's idle share.

Pure functions over what `zerodist.comm.timeline` recorded (one `Recorder` per rank, moved to
rank 0 as plain objects); no process group, so every number here is tested without processes.

[Note: measured overlap] A rank *computes* while it is inside a compute span (a module's forward
or backward, a pipeline F/B/I/W, the optimizer step, the engine's forward/backward/step) and not
blocked in a collective, a message or a wait. A collective is *in flight* from its issue to its
completion. Its *hidden* time is the part of its flight during which the rank computed; the rest
is *exposed* (the rank waited for it, or did other communication). Summed per kind (all_gather,
reduce_scatter, ...), that is Holistic Trace Analysis' "communication-computation overlap",
measured from the CPU side: on a GPU the kernels run later than their launch, so the CPU-side
spans bound the overlap, HTA's kernel view measures it exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from zerodist.comm.timeline import CollectiveSpan, Recorder, Span

Interval = tuple[int, int]

# Spans that are compute (minus the blocked intervals inside them).
COMPUTE_CATS = frozenset({"compute", "step"})
PIPE_COMPUTE = frozenset({"F", "B", "I", "W"})
PIPE_WAITS = frozenset({"RECV_F", "RECV_B"})


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def subtract(base: Sequence[Interval], holes: Sequence[Interval]) -> list[Interval]:
    """`base` minus `holes` (both sorted and disjoint, as `union` returns them)."""
    out: list[Interval] = []
    j = 0
    for start, end in base:
        cursor = start
        while j < len(holes) and holes[j][1] <= cursor:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] < end:
            if holes[k][0] > cursor:
                out.append((cursor, holes[k][0]))
            cursor = max(cursor, holes[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def covered(interval: Interval, intervals: Sequence[Interval]) -> int:
    """How much of `interval` the sorted, disjoint `intervals` cover."""
    start, end = interval
    return sum(max(0, min(end, b) - max(start, a)) for a, b in intervals if a < end and b > start)


def is_pipe_compute(span: Span) -> bool:
    return span.cat == "pipe" and (span.args or {}).get("kind") in PIPE_COMPUTE


def blocked_intervals(recorder: Recorder) -> list[Interval]:
    """Where the rank's thread waited: in collectives, their waits, pipeline receives, watchdog waits."""
    waits = [i for c in recorder.collectives for i in c.blocked]
    waits += [(s.start_ns, s.end_ns) for s in recorder.spans
              if s.cat == "wait" or (s.cat == "pipe" and ((s.args or {}).get("kind") in PIPE_WAITS
                                                          or s.name == "wait sends"))]
    return union(waits)


def compute_intervals(recorder: Recorder) -> list[Interval]:
    """[Note: measured overlap]: compute spans minus the blocked intervals."""
    spans = union((s.start_ns, s.end_ns) for s in recorder.spans if s.cat in COMPUTE_CATS or is_pipe_compute(s))
    return subtract(spans, blocked_intervals(recorder))


@dataclasses.dataclass
class KindOverlap:
    """One kind of communication on all ranks together ([Note: measured overlap])."""

    kind: str
    count: int = 0
    num_bytes: int = 0
    in_flight_ns: int = 0
    hidden_ns: int = 0
    blocked_ns: int = 0

    @property
    def exposed_ns(self) -> int:
        return self.in_flight_ns - self.hidden_ns

    @property
    def hidden_share(self) -> float:
        return self.hidden_ns / self.in_flight_ns if self.in_flight_ns else 0.0


def overlap_by_kind(recorders: Sequence[Recorder]) -> dict[str, KindOverlap]:
    """Per collective kind, summed over ranks: in flight, hidden under compute, exposed, blocked."""
    kinds: dict[str, KindOverlap] = {}
    for recorder in recorders:
        compute = compute_intervals(recorder)
        for c in recorder.collectives:
            entry = kinds.setdefault(c.op, KindOverlap(c.op))
            flight = (c.issue_ns, max(c.end_ns, c.issue_ns))
            entry.count += 1
            entry.num_bytes += c.num_bytes
            entry.in_flight_ns += flight[1] - flight[0]
            entry.hidden_ns += covered(flight, compute)
            entry.blocked_ns += sum(b - a for a, b in c.blocked)
    return kinds


def message_waits(recorders: Sequence[Recorder]) -> tuple[int, int]:
    """(receives, ns) the ranks waited in pipeline receives (RECV_F / RECV_B) and for their sends."""
    waits = [s for r in recorders for s in r.spans
             if s.cat == "pipe" and ((s.args or {}).get("kind") in PIPE_WAITS or s.name == "wait sends")]
    return len(waits), sum(s.end_ns - s.start_ns for s in waits)


def format_overlap(kinds: dict[str, KindOverlap], ranks: int, recorders: Sequence[Recorder] = ()) -> list[str]:
    lines = [f"communication hidden under compute vs exposed, {ranks} rank(s) summed ([Note: measured overlap]):",
             f"  {'kind':<22}{'count':>7}{'MiB':>10}{'in flight ms':>14}{'hidden ms':>11}{'exposed ms':>12}"
             f"{'hidden':>8}"]
    for k in sorted(kinds.values(), key=lambda k: -k.in_flight_ns):
        lines.append(f"  {k.kind:<22}{k.count:>7}{k.num_bytes / 2**20:>10.2f}{k.in_flight_ns / 1e6:>14.2f}"
                     f"{k.hidden_ns / 1e6:>11.2f}{k.exposed_ns / 1e6:>12.2f}{k.hidden_share:>8.0%}")
    count, waited = message_waits(recorders)
    if count:
        lines.append(f"  pipeline messages: {count} receive(s) and send waits took {waited / 1e6:.2f} ms of the ranks' "
                     "time, exposed (the receives are posted ahead; what remains is waiting for the other stage)")
    return lines


# ------------------------------------------------------------------------------------ the pipeline

@dataclasses.dataclass(frozen=True)
class Bar:
    """One pipeline compute action on one rank, in seconds from the picture's origin."""

    kind: str        # F, B, I, W
    stage: int
    microbatch: int
    start: float
    end: float


def pipeline_rows(recorders: Sequence[Recorder], offsets_ns: Sequence[int], window: Interval | None = None,
                  ) -> list[list[Bar]]:
    """Each rank's pipeline compute actions (F/B/I/W) on the aligned clock, in seconds from the
    earliest; `window` (aligned ns) keeps those that start inside it (one step)."""
    raw: list[list[tuple[Span, int]]] = []
    for recorder, offset in zip(recorders, offsets_ns):
        shift = recorder.wall_offset_ns - offset
        spans = [(s, shift) for s in recorder.spans if is_pipe_compute(s)]
        if window is not None:
            spans = [(s, d) for s, d in spans if window[0] <= s.start_ns + d < window[1]]
        raw.append(spans)
    origin = min((s.start_ns + d for spans in raw for s, d in spans), default=0)
    return [[Bar(str((s.args or {})["kind"]), int((s.args or {})["stage"]), int((s.args or {})["microbatch"]),
                 (s.start_ns + d - origin) / 1e9, (s.end_ns + d - origin) / 1e9) for s, d in spans] for spans in raw]


def idle_share(rows: Sequence[Sequence[Bar]]) -> float:
    """Idle time over all ranks' time, time running from the earliest start to the latest end (the
    simulator's `SimulationResult.idle_share`, from measured bars)."""
    bars = [b for row in rows for b in row]
    if not bars or not rows:
        return 0.0
    makespan = max(b.end for b in bars) - min(b.start for b in bars)
    busy = sum(b.end - b.start for b in bars)
    return 1.0 - busy / (makespan * len(rows)) if makespan > 0 else 0.0


# ------------------------------------------------------------------------------------ Chrome trace

def _tracks(recorder: Recorder) -> dict[str, int]:
    names = ["main"] + sorted({s.track for s in recorder.spans} - {"main"})
    names += sorted({f"comm {c.group}" for c in recorder.collectives})
    return {name: index for index, name in enumerate(dict.fromkeys(names))}


def chrome_events(recorders: Sequence[Recorder], offsets_ns: Sequence[int]) -> list[dict[str, Any]]:
    """One Chrome-format event list: a process per rank, a thread per track and per comm group.
    `offsets_ns[r]`: rank r's wall clock minus rank 0's ([Note: timeline clock])."""
    origin = min((r.start_ns + r.wall_offset_ns - o for r, o in zip(recorders, offsets_ns)), default=0)
    events: list[dict[str, Any]] = []
    for recorder, offset in zip(recorders, offsets_ns):
        pid, shift = recorder.rank, recorder.wall_offset_ns - offset - origin
        tracks = _tracks(recorder)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, tid in tracks.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        for s in recorder.spans:
            event = {"name": s.name, "cat": s.cat, "pid": pid, "tid": tracks[s.track], "ts": (s.start_ns + shift) / 1e3,
                     "args": dict(s.args or {})}
            if s.end_ns > s.start_ns or s.cat != "p2p":
                event.update(ph="X", dur=(s.end_ns - s.start_ns) / 1e3)
            else:
                event.update(ph="i", s="t")
            events.append(event)
        for c in recorder.collectives:
            events += _collective_events(c, pid, tracks[f"comm {c.group}"], shift)
    return events


def _collective_events(c: CollectiveSpan, pid: int, tid: int, shift: int) -> list[dict[str, Any]]:
    args = {"bytes": c.num_bytes, "group": c.group, "group_size": c.group_size, "seq": c.seq, "async": c.async_op,
            "issue_us": (c.issued_ns - c.issue_ns) / 1e3, "blocked_us": sum(b - a for a, b in c.blocked) / 1e3}
    events = [{"ph": "X", "name": c.op, "cat": "collective", "pid": pid, "tid": tid, "ts": (c.issue_ns + shift) / 1e3,
               "dur": max(0, c.end_ns - c.issue_ns) / 1e3, "args": args}]
    for start, end in c.blocked:  # the main thread, waiting in it
        events.append({"ph": "X", "name": f"wait {c.op}" if c.async_op else c.op, "cat": "comm wait", "pid": pid,
                       "tid": 0, "ts": (start + shift) / 1e3, "dur": (end - start) / 1e3, "args": {"seq": c.seq}})
    return events


def chrome_trace(recorders: Sequence[Recorder], offsets_ns: Sequence[int], metadata: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
    return {"traceEvents": chrome_events(recorders, offsets_ns), "displayTimeUnit": "ms",
            "otherData": dict(metadata or {})}


def step_window(recorders: Sequence[Recorder], offsets_ns: Sequence[int], step: int) -> Interval | None:
    """The aligned interval from the first rank's start of step `step` to the last rank's end of it."""
    bounds = [(s.start_ns + r.wall_offset_ns - o, s.end_ns + r.wall_offset_ns - o)
              for r, o in zip(recorders, offsets_ns) for s in r.spans
              if s.cat == "step" and (s.args or {}).get("step") == step]
    if not bounds:
        return None
    return min(a for a, _ in bounds), max(b for _, b in bounds)


def pipe_action_counts(recorder: Recorder) -> dict[str, int]:
    """How many spans of each pipeline action kind (F, B, SEND_F, RECV_B, ...) a rank recorded."""
    counts: dict[str, int] = {}
    for s in recorder.spans:
        if s.cat == "pipe" and s.args and "kind" in s.args:
            counts[s.args["kind"]] = counts.get(s.args["kind"], 0) + 1
    return counts
