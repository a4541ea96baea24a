"""`SwapStream`: the host buffers and I/O threads that stream sub-groups through the step, across steps.

[Note: swap I/O across steps] Within a step, sub-group i is stepped while the next ones are read
(read-ahead) and the last ones written (write-behind). Write-behind reaches past the step: the
step returns without waiting for its last writes, which finish while the next forward and
backward run; anything that reads the files first waits for them (a checkpoint's `state_dict`,
a gather of held values, the next step's read of that sub-group), and anything that writes them
drains them first. (Reading the next step's first sub-groups at the step's end was tried: it
saves one read's wait per step but reads state before damage between steps could be seen.)

How far ahead reads go is sized from what was measured: the time one sub-group's read took
against the time one sub-group's step took (the disk's bandwidth against the optimizer's), so
that a read started `depth` sub-groups ahead is done when it is needed; at most `buffer_count - 1`
(one buffer is being stepped). A failed read or write is an `OffloadError` wherever it is waited
for: in a step, where every rank agrees on it ([Note: failures agreed] in optimizer.py).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerodist.offload.subgroups import SubGroup
from zerodist.offload.swap_files import SwapDirectory


class SwapStream:
    """Host buffers of one sub-group file each, a reader and a writer thread, and the reads and writes
    in flight between them ([Note: swap I/O across steps])."""

    def __init__(self, directory: SwapDirectory, buffer_count: int, pipeline_read: bool, pipeline_write: bool):
        self.directory, self.buffer_count = directory, buffer_count
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        self._writes: collections.deque[tuple[Future[None] | None, int, int]] = collections.deque()
        self._reads: dict[int, tuple[Future[None] | None, int]] = {}  # sub-group -> (its read, its buffer)
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="zerodist-swap-read")
        self._writers = ThreadPoolExecutor(1, thread_name_prefix="zerodist-swap-write")
        self.io_wait_s = 0.0  # time the caller spent blocked on reads and writes, all steps
        self._read_s = self._step_s = 0.0  # measured: seconds per sub-group read, per sub-group step
        self._read_count = self._step_count = 0

    # ------------------------------------------------------------------ buffers
    def allocate(self, size: int, count: int) -> None:
        self.drain()
        self.buffers = [torch.empty(size, dtype=torch.uint8, device="cpu") for _ in range(count)]
        self._free = list(range(count))

    @property
    def read_depth(self) -> int:
        """Sub-groups read ahead: measured read time / step time per sub-group, rounded up, plus one."""
        most = max(1, len(self.buffers) - 1)
        if not self._read_count or not self._step_count or self._step_s == 0:
            return most
        ratio = (self._read_s / self._read_count) / (self._step_s / self._step_count)
        return max(1, min(most, math.ceil(ratio) + 1))

    def _acquire(self) -> int:
        while not self._free:
            if self._writes:
                self._finish_write()
            elif self._reads:  # every buffer read ahead for others (never in plan order): drop one
                self._drop_read(next(iter(self._reads)))
            else:
                raise AssertionError("no swap buffer can be freed")
        return self._free.pop()

    # ------------------------------------------------------------------ waiting
    def _wait(self, future: Future[None] | None) -> None:
        if future is None:
            return
        started = time.perf_counter()
        try:
            future.result()
        finally:
            self.io_wait_s += time.perf_counter() - started

    def _finish_write(self) -> None:
        future, index, _ = self._writes.popleft()
        self._free.append(index)
        self._wait(future)

    def _written(self, sub_group: int) -> None:
        """Wait for every write up to the last one of `sub_group`'s file (writes finish in order)."""
        pending = [s for _, _, s in self._writes]
        if sub_group in pending:
            for _ in range(len(pending) - pending[::-1].index(sub_group)):
                self._finish_write()

    def _drop_read(self, sub_group: int) -> None:
        future, index = self._reads.pop(sub_group)
        self._free.append(index)
        self._wait(future)

    def drain(self, keep_reads: bool = False) -> None:
        """Wait for every write in flight (the files are then final) and, unless `keep_reads`, drop the
        reads ahead (the files are about to change under them)."""
        try:
            while self._writes:
                self._finish_write()
        finally:
            if not keep_reads:
                for sub_group in list(self._reads):
                    self._drop_read(sub_group)

    def settle(self) -> None:
        """Wait for every write in flight (a count of the bytes one step moved is then complete, and the
        files hold the step's state)."""
        self.drain(keep_reads=True)

    def drain_quietly(self) -> None:
        """After an error: no I/O thread may still touch a buffer; their own errors are dropped."""
        for future, index, _ in self._writes:
            with contextlib.suppress(Exception):
                future.result() if future is not None else None
            self._free.append(index)
        self._writes.clear()
        for future, index in self._reads.values():
            with contextlib.suppress(Exception):
                future.result() if future is not None else None
            self._free.append(index)
        self._reads.clear()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._readers.shutdown(wait=True)
            self._writers.shutdown(wait=True)
            self.buffers, self._free = [], []

    # ------------------------------------------------------------------ reads and writes
    def _timed_read(self, sub_group: int, target: torch.Tensor) -> None:
        started = time.perf_counter()
        self.directory.read(sub_group, target)
        self._read_s += time.perf_counter() - started
        self._read_count += 1

    def _start_read(self, sub_group: SubGroup, nbytes: int) -> None:
        self._written(sub_group.index)
        index = self._acquire()
        target = self.buffers[index][:nbytes]
        self._reads[sub_group.index] = (self._readers.submit(self._timed_read, sub_group.index, target), index)

    def _take(self, sub_group: SubGroup, nbytes: int) -> int:
        """The buffer holding `sub_group`'s file: its read ahead waited for, or read now."""
        if sub_group.index in self._reads:
            future, index = self._reads.pop(sub_group.index)
            try:
                self._wait(future)
            except BaseException:
                self._free.append(index)
                raise
            return index
        self._written(sub_group.index)
        index = self._acquire()
        started = time.perf_counter()
        try:
            self._timed_read(sub_group.index, self.buffers[index][:nbytes])
        except BaseException:
            self._free.append(index)
            raise
        finally:
            self.io_wait_s += time.perf_counter() - started
        return index

    def _put(self, sub_group: int, index: int, nbytes: int) -> None:
        data = self.buffers[index][:nbytes]
        if self.pipeline_write:
            self._writes.append((self._writers.submit(self.directory.write, sub_group, data), index, sub_group))
            return
        started = time.perf_counter()
        try:
            self.directory.write(sub_group, data)
        finally:
            self.io_wait_s += time.perf_counter() - started
            self._free.append(index)

    def _read_ahead(self, following: Sequence[SubGroup], nbytes: Callable[[SubGroup], int], depth: int) -> None:
        for sub_group in following:
            if len(self._reads) >= depth or len(self._reads) + 1 >= len(self.buffers):
                return
            if sub_group.index not in self._reads:
                self._start_read(sub_group, nbytes(sub_group))

    # ------------------------------------------------------------------ one step
    def stream(self, plan: Sequence[SubGroup], nbytes: Callable[[SubGroup], int],
               step: Callable[[SubGroup, torch.Tensor], Any]) -> None:
        """`step(sub_group, buffer)` for each sub-group in `plan` order, its file read into `buffer` before
        and written from it after ([Note: swap I/O across steps])."""
        read_ahead = self.pipeline_read and len(self.buffers) >= 2
        depth = self.read_depth if read_ahead else 0
        try:
            for position, sub_group in enumerate(plan):
                index = self._take(sub_group, nbytes(sub_group))
                if read_ahead:
                    self._read_ahead(plan[position + 1: position + 1 + depth], nbytes, depth)
                started = time.perf_counter()
                try:
                    step(sub_group, self.buffers[index])
                except BaseException:
                    self._free.append(index)
                    raise
                self._step_s += time.perf_counter() - started
                self._step_count += 1
                self._put(sub_group.index, index, nbytes(sub_group))
        except BaseException:
            self.drain_quietly()
            raise
