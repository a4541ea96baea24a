"""Which rank is slow: per-rank step times gathered and compared.

In data-parallel training every rank waits for the slowest at each gradient collective, so
one slow rank (a throttled GPU, a busy host, a slow data loader) slows the whole job, and
*wall-clock step times look equal on every rank*: the fast ranks spend the difference
waiting inside the collective. Time what a rank does on its own, the part before its first
collective (data loading + forward + backward with the gradient sync excluded, or the data
loader alone), and the slow rank stands out:

    timer = StepTimer()
    for batch in loader:
        with timer.step():
            loss = model(batch); loss.backward()   # no collective inside
        sync_gradients(); optimizer.step()
    report = timer.report()            # collective: every rank calls it
    logger.info("%s", report.format())
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from zerodist import comm
from zerodist.comm import Group


@dataclasses.dataclass(frozen=True)
class RankStepTimes:
    """One rank's step times, summarised (NaN when it timed no step)."""

    rank: int
    num_steps: int
    mean_s: float
    median_s: float
    max_s: float


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """Every rank's step times; `spread` = slowest median / fastest median (1.0 = balanced)."""

    ranks: tuple[RankStepTimes, ...]
    slowest_rank: int
    fastest_rank: int
    spread: float

    def stragglers(self, threshold: float = 1.1) -> list[int]:
        """Ranks whose median step is more than `threshold` x the median of all ranks' medians."""
        timed = [r for r in self.ranks if r.num_steps]
        typical = statistics.median(r.median_s for r in timed)
        return [r.rank for r in timed if r.median_s > threshold * typical]

    def format(self) -> str:
        lines = [f"{'rank':>6}{'steps':>7}{'mean ms':>10}{'median ms':>11}{'max ms':>10}"]
        for r in self.ranks:
            marker = "  <- slowest" if r.rank == self.slowest_rank else ""
            lines.append(
                f"{r.rank:>6}{r.num_steps:>7}{r.mean_s * 1e3:>10.2f}{r.median_s * 1e3:>11.2f}{r.max_s * 1e3:>10.2f}{marker}"
            )
        lines.append(
            f"spread (slowest / fastest median): {self.spread:.2f}x; slowest rank {self.slowest_rank}, "
            f"fastest rank {self.fastest_rank}"
        )
        return "\n".join(lines)


def summarise(rank: int, step_times_s: list[float]) -> RankStepTimes:
    if not step_times_s:
        return RankStepTimes(rank, 0, math.nan, math.nan, math.nan)
    return RankStepTimes(
        rank, len(step_times_s), statistics.fmean(step_times_s), statistics.median(step_times_s), max(step_times_s)
    )


def straggler_report(step_times_s: list[float], group: Group = None) -> StragglerReport:
    """Gather every rank's step times (all_gather_object) and name the slowest rank.

    Collective: call it on every rank of `group`; every rank gets the same report. Ranks are
    global ranks.
    """
    mine = summarise(comm.get_rank(), [float(t) for t in step_times_s])
    gathered: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(gathered, mine, group=group)
    timed = [r for r in gathered if r.num_steps]
    if not timed:
        raise ValueError("straggler_report: no rank timed any step")
    slowest = max(timed, key=lambda r: r.median_s)
    fastest = min(timed, key=lambda r: r.median_s)
    spread = slowest.median_s / fastest.median_s if fastest.median_s > 0 else math.inf
    return StragglerReport(tuple(gathered), slowest.rank, fastest.rank, spread)


class StepTimer:
    """Collects this rank's step durations: `with timer.step(): ...` or `start()` / `stop()`.

    `warmup_steps` first steps are dropped (lazy connections and allocator warm-up make them
    slow on every rank). On a GPU, `synchronize_cuda` waits for queued kernels before reading
    the clock, so the time is the device's, not the launch's.
    """

    def __init__(self, *, warmup_steps: int = 0, synchronize_cuda: bool = True):
        self.warmup_steps = warmup_steps
        self.synchronize_cuda = synchronize_cuda
        self.times_s: list[float] = []
        self._num_seen = 0
        self._started: float | None = None

    def start(self) -> None:
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> float:
        """End the step; returns its duration in seconds."""
        if self._started is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self._sync()
        elapsed = time.perf_counter() - self._started
        self._started = None
        self._num_seen += 1
        if self._num_seen > self.warmup_steps:
            self.times_s.append(elapsed)
        return elapsed

    @contextmanager
    def step(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def report(self, group: Group = None) -> StragglerReport:
        """`straggler_report(self.times_s, group)`: collective."""
        return straggler_report(self.times_s, group)

    def _sync(self) -> None:
        if self.synchronize_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
