"""What the engine observes of a loop of the user's own: DeepSpeed's `wall_clock_breakdown` and
`flops_profiler`, and zerodist's `zerodist.timeline`, with no call added to the loop.

    engine(batch); engine.backward(loss); engine.step()     # each call is a phase of the step

The engine wraps `forward`, `backward`, `step` and `train_batch` in `PhaseTiming.phase(name)`. A
step begins at the first phase after the previous optimizer step and ends when the phase that
stepped the optimizer returns, so each step's wall time (previous step's end to this one's; the
first from its first phase) holds all of its phases:

- `wall_clock_breakdown`: every `steps_per_print` steps, rank 0 logs the mean per optimizer step of
  `fwd`, `bwd`, `bwd_allreduce` (the time backward spent blocked in collectives: the gradient
  reduction it did not overlap, [Note: blocked time] in zerodist/comm/tracer.py), `step` and
  `wall`, DeepSpeed's `time (ms) | fwd: ... | bwd: ... | step: ...` line; `PhaseTiming.last` holds
  the same numbers. A pipeline's `fwd` and `bwd` are its executor's timed actions (F; B, I, W).
  The monitor sections get DeepSpeed's `Train/Samples/elapsed_time_ms_{forward, backward,
  backward_inner, backward_allreduce, step}` events, each step's.
- `flops_profiler`: the FLOPs of step `profile_step` (every forward and backward of it, on this
  rank) are counted ([Note: counting FLOPs] in zerodist/debug/flops.py), per module with each
  module's forward time; rank 0 logs the profile, or writes it to `output_file`.
- `zerodist.timeline`: the chosen steps are recorded with `zerodist.debug.timeline.StepTimeline`
  and merged right after the last of them (collective: every rank ends that step together) into
  `output_dir` (default `./timeline`). A recording already running when the window opens (the one
  `zerodist train --trace` makes around its steps) is not doubled: the engine's stands down.

Off, each phase costs one attribute test.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zerodist.comm as comm
from zerodist.comm import timeline
from zerodist.debug.flops import FlopCount, FlopSession, device_peak, format_flops_table, session_open
from zerodist.debug.timeline import StepTimeline
from zerodist.utils import get_logger, log_rank0
from zerodist.zero import full_shape

logger = get_logger(__name__)

__all__ = ["PhaseTiming"]

_NOTHING = contextlib.nullcontext()  # what phase() is when nothing is observed: one attribute test a call

# The phase names the engine passes -> DeepSpeed's timer names in the logged line.
DEEPSPEED_NAMES = {"forward": "fwd", "backward": "bwd", "step": "step"}


class PhaseTiming:
    """One engine's phase timer, FLOPs profile and timeline window (made by the engine, every rank)."""

    def __init__(self, engine: Any):
        config = engine.config
        self.engine = engine
        self.breakdown = bool(config.wall_clock_breakdown)
        self.every = config.steps_per_print or 0
        self.profiler = config.flops_profiler
        settings = config.zerodist.timeline
        self.timeline: StepTimeline | None = None
        if settings.enabled:
            module = engine.module if settings.module_spans and engine.pipeline is None else None
            self.timeline = StepTimeline(Path(settings.output_dir or "timeline"), start_step=settings.start_step,
                                         num_steps=settings.num_steps, torch_profiler=settings.torch_profiler,
                                         module=module)
        self.profiling = bool(self.profiler.enabled)  # until the profile step began
        self.active = self.breakdown or self.profiling or self.timeline is not None
        self.totals: dict[str, float] = {}   # seconds per timer since the last logged line
        self.interval_steps = 0
        self.last: dict[str, float] = {}     # the last logged line's means per step, in ms
        self.flops: FlopCount | None = None  # the profile step's count, once counted
        self.flops_lines: list[str] = []
        self._flops_session: FlopSession | None = None
        self._phases: dict[str, float] = {}
        self._depth = 0
        self._step_begun: float | None = None  # the previous optimizer step's end (or the first phase's start)
        self._in_step = False
        self._window = contextlib.ExitStack()

    # ------------------------------------------------------------------ around each engine call
    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Around one engine call (`forward`, `backward`, `step`, `train_batch`)."""
        return self._phase(name) if self.active else _NOTHING

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        outer = self._depth == 0
        if outer and not self._in_step:
            self._begin_step()
        steps = self.engine.global_steps
        self._depth += 1
        started = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack:
                if name in DEEPSPEED_NAMES:
                    stack.enter_context(timeline.span("step", name))
                blocked = stack.enter_context(comm.measure_blocked()) if self.breakdown and name == "backward" else None
                if self._flops_session is not None:
                    stack.enter_context(self._flops_session.counting())
                yield
        finally:
            self._depth -= 1
        if name in DEEPSPEED_NAMES:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - started
        if blocked is not None:
            self._phases["bwd_allreduce"] = self._phases.get("bwd_allreduce", 0.0) + blocked.seconds
        if outer and self.engine.global_steps > steps:
            self._end_step()

    def _begin_step(self) -> None:
        self._in_step = True
        if self._step_begun is None:
            self._step_begun = time.perf_counter()
        step = self.engine.global_steps + 1
        if self.timeline is not None and self.timeline.wants(step):
            if self.timeline.recorder is None and timeline.current() is not None:
                log_rank0(logger, "zerodist.timeline: a recording is already running (zerodist train --trace's); "
                          "the engine's stands down", level=logging.DEBUG)
                self.timeline = None
            else:
                self._window.enter_context(self.timeline.step(step))
        if self.profiling and step >= self.profiler.profile_step:
            self.profiling = False  # one profile a run
            if session_open():  # zerodist train counts this step itself and reports it
                log_rank0(logger, "flops_profiler: a FLOP count is already under way (zerodist train's); the "
                          "engine's stands down", level=logging.DEBUG)
            else:
                self._flops_session = FlopSession(self.engine.module)

    def _end_step(self) -> None:
        now = time.perf_counter()
        assert self._step_begun is not None
        phases, self._phases = self._phases, {}
        if self.engine.pipeline is not None:
            self._pipeline_phases(phases)
        phases["wall"] = now - self._step_begun
        self._step_begun, self._in_step = now, False  # the next step's wall time runs from here
        self._window.close()  # the timeline's step window, if it recorded this one
        step = self.engine.global_steps
        if self._flops_session is not None:
            self._finish_profile(step, phases)
        if self.timeline is not None and self.timeline.recorder is not None and step == self.timeline.last:
            report = self.timeline.finish({"steps_by": "engine"})
            for line in report.lines:
                log_rank0(logger, "%s", line)
        if self.breakdown:
            self._log_breakdown(step, phases)
            self._write_monitors(step, phases)

    def _pipeline_phases(self, phases: dict[str, float]) -> None:
        run = self.engine.last_run
        if run is not None:
            for name, kinds in (("forward", {"F"}), ("backward", {"B", "I", "W"})):
                phases[name] = sum(a.end - a.start for a in run.trace if a.action.kind.value in kinds)

    def _log_breakdown(self, step: int, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.interval_steps += 1
        if not self.every or step % self.every:
            return
        order = ["forward", "backward", "bwd_allreduce", "step", "wall"]
        self.last = {DEEPSPEED_NAMES.get(n, n): self.totals[n] * 1e3 / self.interval_steps
                     for n in order if n in self.totals}
        log_rank0(logger, "step %d: time (ms) | %s (mean per optimizer step over the last %d)", step,
                  " | ".join(f"{name}: {ms:.3f}" for name, ms in self.last.items()), self.interval_steps)
        self.totals, self.interval_steps = {}, 0

    def _write_monitors(self, step: int, phases: dict[str, float]) -> None:
        """DeepSpeed's events for the monitor sections, this step's times in ms (rank 0 writes)."""
        monitors = self.engine.monitors
        if not monitors or comm.get_rank() != 0:
            return
        names = {"forward": "forward", "backward": "backward", "bwd_allreduce": "backward_allreduce", "step": "step"}
        events = {f"Train/Samples/elapsed_time_ms_{event}": phases[name] * 1e3
                  for name, event in names.items() if name in phases}
        if "backward" in phases:
            events["Train/Samples/elapsed_time_ms_backward_inner"] = (
                phases["backward"] - phases.get("bwd_allreduce", 0.0)) * 1e3
        monitors.write_scalars(step * self.engine.batch.train_batch_size, events)

    # ------------------------------------------------------------------ the FLOPs profile
    def _finish_profile(self, step: int, phases: dict[str, float]) -> None:
        session, self._flops_session = self._flops_session, None
        assert session is not None
        module = self.engine.module
        params = {name: sum(full_shape(p).numel() for p in child.parameters())
                  for name, child in module.named_modules()}
        self.flops = count = session.finish(params)
        self.flops_lines = self._profile_lines(step, count, phases)
        if comm.get_rank() != 0:
            return
        if self.profiler.output_file:
            path = Path(self.profiler.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(self.flops_lines) + "\n", encoding="utf-8")
            logger.info("flops profiler: step %d's profile written to %s", step, path)
        else:
            logger.info("%s", "\n".join(self.flops_lines))

    def _profile_lines(self, step: int, count: FlopCount, phases: dict[str, float]) -> list[str]:
        wall = phases["wall"]
        forward = count.forward.get("", 0)
        lines = ["-------------------------- zerodist flops profiler (DeepSpeed's keys) --------------------------",
                 f"profile of step {step} (rank 0; matrix products, [Note: counting FLOPs] in zerodist/debug/flops.py)",
                 f"world size:                    {comm.get_world_size()}",
                 f"params (whole model):          {count.params.get('', 0):,}",
                 f"fwd flops per rank:            {forward:,}",
                 f"fwd+bwd flops per rank:        {count.total:,}",
                 f"step latency:                  {wall * 1e3:.2f} ms",
                 f"FLOP/s per rank:               {count.total / wall / 1e9 if wall > 0 else 0:.3f} GFLOP/s"]
        device = comm.device_for_rank()
        if device.type == "cuda":  # the table's peak; a CPU's is measured, which zerodist train does
            peak, source = device_peak(device, self.engine.policy.param_dtype)
            if peak:
                lines.append(f"MFU:                           {count.total / wall / peak:.1%} of {source}")
        if self.profiler.detailed:
            depth = self.profiler.module_depth
            lines += ["per module (forward FLOPs and time, largest first):",
                      *format_flops_table(count, depth=depth if depth >= 0 else 99, top=self.profiler.top_modules)]
        return lines

    def close(self) -> None:
        """Stop what is still recording (the engine is destroyed mid-window) and remove the hooks."""
        self._window.close()
        if self._flops_session is not None:
            self._flops_session.finish({})
            self._flops_session = None
