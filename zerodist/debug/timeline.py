"""See a step: every rank's compute, collectives, messages and swap I/O on one clock.

    session = StepTimeline(out_dir, start_step=2, num_steps=1, module=model)
    for step in range(1, steps + 1):
        with session.step(step):            # records only the chosen steps
            train_step()
    report = session.finish()               # collective: every rank calls it; rank 0 writes
    report.lines                            # overlap per kind (rank 0), the files written

What it writes under `out_dir` (rank 0 the merged files, every rank its own profiler trace):
- `timeline.json`: one Chrome-format trace (`traceEvents`; a process per rank, a thread per track:
  main, each communication group, p2p, swap, watchdog) for Perfetto's UI or chrome://tracing;
- `traces/rank<r>.json`: torch.profiler's own trace of the same steps on rank r, with every span
  above as a `record_function` range, which Holistic Trace Analysis loads as one multi-rank trace
  (`TraceAnalysis(trace_dir=out_dir/"traces")`).

The recording itself is `zerodist.comm.timeline` (layer 3, so that pipe/, zero/ and offload/ can
record); this module chooses the steps, aligns the clocks ([Note: timeline clock]), adds compute
spans per module (forward pre/post hooks; backward from gradient hooks on each module's output
and input, nothing set on the modules), merges on rank 0 and measures ([Note: measured overlap]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zerodist import comm
from zerodist.comm import timeline
from zerodist.comm.timeline import Recorder
from zerodist.debug.timeline_analysis import chrome_trace, format_overlap, overlap_by_kind
from zerodist.utils import get_logger

logger = get_logger(__name__)

__all__ = ["StepTimeline", "TimelineReport", "align_clocks", "traced_modules"]


def align_clocks(rounds: int = 5) -> list[int]:
    """Every rank's wall clock minus rank 0's, in ns (collective; [Note: timeline clock] in
    zerodist/comm/timeline.py): ranks on rank 0's host share its clock (0); for the others, the median
    over `rounds` of a barrier then an all-gather of the wall clock read as each rank leaves it."""
    samples: list[list[int]] = []
    for _ in range(rounds):
        comm.barrier()
        now = time.time_ns()
        everyone: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(everyone, (socket.gethostname(), now))
        samples.append([int(t) - int(everyone[0][1]) for _, t in everyone])
    hosts = [host for host, _ in everyone]
    return [0 if hosts[r] == hosts[0] else int(statistics.median(s[r] for s in samples)) for r in range(len(hosts))]


def traced_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose forward and backward become spans: the model's children, a ModuleList's or
    Sequential's items in its place (a GPT's embedding, each block, the final norm, the head)."""
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            chosen += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            chosen.append((name, child))
    return chosen


class _ModuleSpans:
    """Forward spans from forward pre/post hooks; backward spans from gradient hooks on the output
    (its gradient arrives: the module's backward starts) and on the input (its gradient is done)."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.handles: list[Any] = []
        self.started: dict[int, int] = {}             # id(module) -> its forward's start
        self.marks: dict[int, dict[str, int]] = {}    # id(module) -> its backward's start, once known
        for name, module in modules:
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.started[id(module)] = timeline.now()
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                marks: dict[str, int] = {}
                first.register_hook(self._backward_end(name, marks))
                self.marks[id(module)] = marks
        return pre

    def _post(self, name: str) -> Any:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            begin = self.started.pop(id(module), None)
            if begin is None:
                return
            timeline.add("compute", f"forward {name}", begin, timeline.now(), args={"module": name})
            marks = self.marks.pop(id(module), None)
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            out = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
            if marks is not None and out is not None and out.requires_grad:
                out.register_hook(self._backward_start(marks))
        return post

    @staticmethod
    def _backward_start(marks: dict[str, int]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            marks.setdefault("start", timeline.now())
        return hook

    @staticmethod
    def _backward_end(name: str, marks: dict[str, int]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if "start" in marks:
                timeline.add("compute", f"backward {name}", marks["start"], timeline.now(), args={"module": name})
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclasses.dataclass
class TimelineReport:
    """What `StepTimeline.finish()` returns on every rank; `lines`, `recorders` and the paths on rank 0."""

    lines: list[str]
    recorders: list[Recorder]
    offsets_ns: list[int]
    tracer_counts: list[dict[str, int]]    # per rank: what the communication tracer counted per op
    merged: Path | None = None
    rank_traces: list[Path] = dataclasses.field(default_factory=list)
    steps: tuple[int, ...] = ()


class StepTimeline:
    """Records steps `start_step .. start_step + num_steps - 1` on every rank (`step()` around each
    step: the same steps on every rank, since the first one aligns the clocks with a collective)."""

    def __init__(self, out_dir: str | Path, *, start_step: int = 2, num_steps: int = 1,
                 module: torch.nn.Module | None = None, torch_profiler: bool = True):
        self.out_dir = Path(out_dir)
        self.first, self.last = start_step, start_step + num_steps - 1
        self.modules = traced_modules(module) if module is not None else []
        self.use_profiler = torch_profiler
        self.offsets: list[int] | None = None
        self.recorder: Recorder | None = None
        self.trace: Any = None          # the communication tracer's context over the window
        self.counts: Any = None         # ... and what it counts (per op, for the merged trace's metadata)
        self.profiler: Any = None
        self.module_spans: _ModuleSpans | None = None
        self.steps: list[int] = []

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one optimizer step; records it when chosen, else does nothing."""
        if not self.wants(step):
            yield
            return
        if self.recorder is None:
            self._start()
        self.steps.append(step)
        try:
            with timeline.span("step", f"step {step}", step=step), self._profiled(f"ProfilerStep#{step}"):
                yield
        except BaseException:
            self._stop()  # no recorder, hook or profiler outlives a failed step
            raise
        if step == self.last:
            self._stop()

    def _profiled(self, name: str) -> Any:
        if self.profiler is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)

    def _start(self) -> None:
        self.offsets = align_clocks()
        if self.use_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        self.trace = comm.trace(keep_records=False)
        self.counts = self.trace.__enter__()
        self.module_spans = _ModuleSpans(self.modules)
        self.recorder = timeline.start(comm.get_rank())

    def _stop(self) -> None:
        if timeline.current() is not self.recorder:
            return  # stopped already
        timeline.stop()
        if self.module_spans is not None:
            self.module_spans.remove()
        self.trace.__exit__(None, None, None)
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            path = self.out_dir / "traces" / f"rank{comm.get_rank()}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(path))
            self.profiler = None

    def finish(self, metadata: dict[str, Any] | None = None) -> TimelineReport:
        """Gather every rank's records to all ranks and write the merged trace on rank 0 (collective)."""
        if self.recorder is not None:
            self._stop()  # the run ended inside the window (a no-op when it was stopped)
        counts = {op: s.count for op, s in self.counts.summary().items()} if self.recorder is not None else {}
        mine = (self.recorder, counts)
        everyone: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(everyone, mine)
        recorders = [r for r, _ in everyone if r is not None]
        tracer_counts = [c for _, c in everyone]
        offsets = self.offsets or [0] * len(everyone)
        report = TimelineReport([], recorders, offsets, tracer_counts, steps=tuple(self.steps))
        if comm.get_rank() != 0 or not recorders:
            return report
        self.out_dir.mkdir(parents=True, exist_ok=True)
        report.merged = self.out_dir / "timeline.json"
        info = {"steps": self.steps, "clock_offsets_ns": offsets, "tracer_counts": tracer_counts, **(metadata or {})}
        report.merged.write_text(json.dumps(chrome_trace(recorders, offsets, info)), encoding="utf-8")
        if self.use_profiler:
            report.rank_traces = [self.out_dir / "traces" / f"rank{r.rank}.json" for r in recorders]
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        report.lines = [f"timeline of {steps} on {len(recorders)} rank(s):",
                        *format_overlap(overlap_by_kind(recorders), len(recorders), recorders),
                        f"wrote {report.merged} (Chrome trace: open in ui.perfetto.dev)" + (
                            f" and {self.out_dir / 'traces'}/rank<r>.json (torch.profiler; Holistic Trace Analysis "
                            "reads the folder)" if self.use_profiler else "")]
        return report
