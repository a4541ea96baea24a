"""`SwapStream` ([Note: swap I/O across steps] in zerodist/offload/stream.py) over a directory stand-in:
reads go as far ahead as the measured read and step times ask, the step's last writes finish after it
returns (and before anything reads that file again), and every sub-group is stepped on its own file."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from zerodist.offload.stream import SwapStream
from zerodist.offload.subgroups import Piece, SubGroup

pytestmark = pytest.mark.unit
NBYTES = 64


class _Files:
    """Sub-group files in memory; reads take `read_s`, writes wait for `release` (when given)."""

    def __init__(self, count: int, read_s: float = 0.0, release: threading.Event | None = None):
        self.data = {i: torch.full((NBYTES,), i, dtype=torch.uint8) for i in range(count)}
        self.read_s, self.release = read_s, release
        self.log: list[tuple[str, int]] = []

    def read(self, index: int, target: torch.Tensor) -> None:
        time.sleep(self.read_s)
        target.copy_(self.data[index])
        self.log.append(("read", index))

    def write(self, index: int, data: torch.Tensor) -> None:
        if self.release is not None:
            self.release.wait(10)
        self.data[index] = data.clone()
        self.log.append(("write", index))


def _plan(count: int) -> list[SubGroup]:
    return [SubGroup(i, (Piece(0, 0, i * 16, 16),)) for i in range(count)]


def _stream(files: _Files, buffers: int = 4) -> SwapStream:
    stream = SwapStream(files, buffers, pipeline_read=True, pipeline_write=True)  # type: ignore[arg-type]
    stream.allocate(NBYTES, buffers)
    return stream


def _add_one(step_s: float = 0.0):
    def step(sub_group: SubGroup, buffer: torch.Tensor) -> None:
        time.sleep(step_s)
        assert bool((buffer[:NBYTES] == buffer[0]).all())  # the buffer holds this sub-group's whole file
        buffer[:NBYTES] += 1
    return step


def test_every_sub_group_is_stepped_on_its_own_file_across_steps():
    files = _Files(6)
    stream = _stream(files, buffers=3)
    for _ in range(3):
        stream.stream(_plan(6), lambda sg: NBYTES, _add_one())
    stream.settle()
    assert all(bool((files.data[i] == i + 3).all()) for i in range(6))
    stream.close()


class _ThreadClock:
    """Seconds per thread that pass only when a read or a step spends them: the stream's measured read
    and step times are then exactly what the test gives them. (Real 20 ms sleeps against steps of
    microseconds decided the depth by a margin a loaded 2-core machine's scheduling can exceed.)"""

    def __init__(self):
        self._now = threading.local()

    def perf_counter(self) -> float:
        return getattr(self._now, "seconds", 0.0)

    def spend(self, seconds: float) -> None:
        self._now.seconds = self.perf_counter() + seconds


def test_reads_go_as_far_ahead_as_the_measured_times_ask(monkeypatch):
    import zerodist.offload.stream as stream_module

    clock = _ThreadClock()
    monkeypatch.setattr(stream_module, "time", clock)  # the module's only use of time is perf_counter
    monkeypatch.setattr(_Files, "read", lambda self, index, target: (clock.spend(self.read_s), target.copy_(self.data[index])))

    def step(step_s: float):
        return lambda sub_group, buffer: (clock.spend(step_s), buffer[:NBYTES].add_(1))

    slow_reads = _stream(_Files(8, read_s=0.02))
    slow_reads.stream(_plan(8), lambda sg: NBYTES, step(0.0001))
    assert slow_reads.read_depth == 3  # reads far slower than steps: as deep as the buffers allow
    slow_reads.close()
    slow_steps = _stream(_Files(8, read_s=0.0001))
    slow_steps.stream(_plan(8), lambda sg: NBYTES, step(0.02))
    assert slow_steps.read_depth == 2  # steps far slower than reads: one ahead is enough, plus one
    slow_steps.close()
    even = _stream(_Files(8, read_s=0.02), buffers=6)
    even.stream(_plan(8), lambda sg: NBYTES, step(0.01))
    assert even.read_depth == 3  # reads twice the step, buffers to spare: two ahead, plus one
    even.close()


def test_the_last_writes_finish_after_the_step_and_before_the_next_read_of_their_file():
    release = threading.Event()
    files = _Files(2, release=release)
    stream = _stream(files, buffers=4)
    stream.stream(_plan(2), lambda sg: NBYTES, _add_one())
    assert ("write", 1) not in files.log  # the step returned with its writes in flight
    release.set()
    stream.stream(_plan(2), lambda sg: NBYTES, _add_one())  # its reads wait for those writes
    stream.settle()
    assert all(bool((files.data[i] == i + 2).all()) for i in range(2))
    stream.close()
