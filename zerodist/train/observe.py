"""What `zerodist train` observes of its steps besides the loss: the timeline (`--trace`), FLOPs,
FLOP/s and MFU, and the wall-clock breakdown (forward / backward / optimizer step).

    observer = StepObserver(engine.config, plan.out, model)    # every rank; measures the CPU peak
    with observer.step(step):                                  # the timeline's window
        observer.run(step, lambda: ...)                        # counts FLOPs at flops_profiler.profile_step
        with observer.phase("forward"): ...                    # inside the step: its breakdown
    observer.columns(seconds)                                  # metrics.csv's tflops, mfu, *_ms
    lines = observer.finish()                                  # collective; rank 0's summary lines

The FLOP count is [Note: counting FLOPs] in zerodist/debug/flops.py; the peak [Note: peak FLOP/s].
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.debug.flops import FlopCount, count_flops, device_peak, format_flops_table
from zerodist.debug.timeline import StepTimeline, TimelineReport
from zerodist.utils import get_logger

logger = get_logger(__name__)

__all__ = ["StepObserver"]


class StepObserver:
    """One rank's observer of a demo run (built on every rank: the peak and the timeline are collective)."""

    def __init__(self, config: Any, out: Path, module: torch.nn.Module | None, *, dtype: torch.dtype,
                 module_spans: bool = True):
        settings = config.zerodist.timeline
        self.session: StepTimeline | None = None
        if settings.enabled:
            self.session = StepTimeline(Path(settings.output_dir or out / "timeline"), start_step=settings.start_step,
                                        num_steps=settings.num_steps, torch_profiler=settings.torch_profiler,
                                        module=module if settings.module_spans and module_spans else None)
        self.profiler = config.flops_profiler
        self.module = module
        self.flops: FlopCount | None = None
        self.counted_step = 0
        self.flops_table: list[str] = []
        self.phases: dict[str, float] = {}
        self.timeline_report: TimelineReport | None = None
        comm.barrier()  # every rank measures at once: the peak is one rank's share of the machine
        self.peak, self.peak_source = device_peak(comm.device_for_rank(), dtype)
        self.busy_s = 0.0         # seconds of the steps after the counted one, for the summary's MFU
        self.busy_steps = 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        with self.session.step(step) if self.session is not None else contextlib.nullcontext():
            yield

    def run(self, step: int, fn: Callable[[], Any]) -> Any:
        """`fn()`, under the FLOP counter at the profile step (or the first step after it that runs: a
        resumed run starts later)."""
        if self.flops is not None or step < self.profiler.profile_step:
            return fn()
        self.counted_step = step
        self.flops, result = count_flops(fn, self.module)
        depth = self.profiler.module_depth
        self.flops_table = format_flops_table(self.flops, depth=depth if depth >= 0 else 99,
                                              top=self.profiler.top_modules) if self.profiler.detailed else []
        return result

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase of the step (summed over its micro-steps), for metrics.csv's columns."""
        start = time.perf_counter()
        yield  # the engine records the phase's span itself (zerodist/engine/phase_timing.py)
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def pipeline_phases(self, run: Any) -> None:
        """A pipeline step's breakdown from its executor's timed actions (F; B, I and W), for the
        row `columns` writes next."""
        if run is not None:
            for name, kinds in (("forward", {"F"}), ("backward", {"B", "I", "W"})):
                self.phases[name] = sum(a.end - a.start for a in run.trace if a.action.kind.value in kinds)

    def columns(self, step: int, seconds: float) -> dict[str, float | None]:
        """This step's metrics.csv columns: TFLOP/s of this rank, MFU, and the breakdown in ms of the
        phases timed since the last row. The demo writes a row before the step's optimizer step (which
        may save: [Note: rows before the save] in zerodist/train/loop.py), so a row's `step_ms` is the
        optimizer step that ended the previous row's step, its forward and backward this step's."""
        phases, self.phases = self.phases, {}
        achieved = self.flops.total / seconds if self.flops is not None and seconds > 0 else None
        if self.flops is not None and step > self.counted_step:
            self.busy_s += seconds
            self.busy_steps += 1
        # wall_clock_breakdown's log line is the engine's (zerodist/engine/phase_timing.py)
        return {"tflops": achieved / 1e12 if achieved is not None else None,
                "mfu": achieved / self.peak if achieved is not None and self.peak else None,
                **{f"{name}_ms": s * 1e3 for name, s in phases.items()}}

    def finish(self, metadata: dict[str, Any] | None = None) -> list[str]:
        """Collective: the timeline merged, every rank's FLOPs gathered; rank 0's summary lines."""
        if self.session is not None:
            self.timeline_report = self.session.finish(metadata)
        mine = (self.flops.total if self.flops is not None else None, self.peak, self.busy_s, self.busy_steps)
        everyone: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(everyone, mine)
        if comm.get_rank() != 0:
            return []
        lines = self._flops_lines(everyone)
        if self.profiler.output_file:  # DeepSpeed's flops_profiler.output_file: the FLOPs report goes there
            Path(self.profiler.output_file).write_text("\n".join(lines) + "\n", encoding="utf-8")
            lines = [f"FLOPs report written to {self.profiler.output_file}"]
        if self.timeline_report is not None:
            lines += self.timeline_report.lines or [
                f"timeline: nothing recorded: steps {self.session.first}-{self.session.last} (zerodist.timeline) were "
                "not run; choose steps this run reaches"] if self.session is not None else []
        return lines

    def _flops_lines(self, everyone: list[Any]) -> list[str]:
        if any(flops is None for flops, *_ in everyone):
            return [f"FLOPs: not counted (flops_profiler.profile_step {self.profiler.profile_step} was not run)"]
        totals = [flops for flops, *_ in everyone]
        rates = [flops * steps / busy for flops, _, busy, steps in everyone if busy > 0]
        lines = [f"FLOPs per step (step {self.counted_step}, matrix products, [Note: counting FLOPs]): "
                 f"{sum(totals) / 1e9:.2f} GFLOPs on all ranks, {totals[0] / 1e9:.2f} on rank 0"]
        if rates:
            peaks = [peak for _, peak, busy, _ in everyone if busy > 0]
            mfus = [rate / peak for rate, peak in zip(rates, peaks) if peak]
            mfu = f"MFU {sum(mfus) / len(mfus):.1%}" if mfus else "MFU unknown"
            lines.append(f"  achieved {sum(rates) / len(rates) / 1e12:.4f} TFLOP/s per rank (mean over ranks, steps "
                         f"after the counted one); {mfu} of {self.peak_source}: "
                         f"{(self.peak or 0) / 1e12:.4f} TFLOP/s on rank 0")
        if self.flops_table:
            lines += ["  per module (rank 0; forward FLOPs, as DeepSpeed's profiler prints them):", *self.flops_table]
        return lines
