"""The swap directory of one rank and the plain file I/O on it, with byte counters.

    <nvme_path>/<run>/rank<r>/subgroup<i>.swp     one file per sub-group ([Note: sub-groups] in
                                                   subgroups.py): each state kind's pieces, in order

Swap files are scratch, never checkpoints: `close()` removes them (the engine's `destroy()`
calls it); a process that dies leaves them for inspection, and the line logged when they were
made says where. Reads and writes are `os.preadv` / `os.pwrite` on a tensor's own memory (no
copy, and the GIL is released while the kernel copies), so the I/O threads of the pipelined
step overlap the optimizer's arithmetic. An async I/O library was not needed: on these machines
plain buffered I/O runs at memory speed until the page cache is full, and the pipeline hides it.

[Note: swap checksums] Every block of `_BLOCK` bytes of every swap file has a crc32, computed from
the bytes as they are written and kept in memory (never in the file: a file moved or copied over
another then carries the wrong sums, not its own); every read checks the blocks it covers, so a
file changed behind the engine's back (an overwrite of the same size, a bit flip, two files
swapped) is a `SwapChecksumError` naming the file and the bytes at the read that meets it. The
optimizer agrees I/O failures over its ranks and a checkpoint save fails on every rank when one
rank's read fails, so the damage is the same named error everywhere and never reaches a checkpoint.
A read or write that does not start and end on block boundaries reads the boundary blocks (checked)
to compute or check their sums; the step's reads and writes are whole files, so only checkpoint
save/load touch those. zlib's crc32 runs at about 4 GB/s here and releases the GIL, so the I/O
threads compute it while the optimizer steps (docs/offload.md has the measured cost).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

import torch

from zerodist.comm import timeline
from zerodist.offload.errors import SwapChecksumError, SwapFileError, SwapPathError, SwapSpaceError

_BLOCK = 1 << 20  # bytes per checksum ([Note: swap checksums])


@dataclasses.dataclass
class SwapCounters:
    """What this rank moved to and from its swap files, in bytes and calls, since it was made."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    checksum_s: float = 0.0  # CPU seconds (thread time) spent on the swap files' crc32s ([Note: swap checksums])

    def snapshot(self) -> SwapCounters:
        return dataclasses.replace(self)


def check_swap_root(root: str | os.PathLike[str], needed_bytes: int) -> str | None:
    """Why `root` cannot hold `needed_bytes` of swap files, or None. (A problem, not an exception:
    every rank's answer is compared first, so that every rank raises the same error.)"""
    path = Path(root)
    if not path.exists():
        return f"nvme_path {str(path)!r} does not exist; create it (or point nvme_path at a directory that does)"
    if not path.is_dir():
        return f"nvme_path {str(path)!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"nvme_path {str(path)!r} is not writable by this process; fix its permissions or choose another"
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        return (f"nvme_path {str(path)!r} has {free / 2**20:.1f} MiB free but the swap files need "
                f"{needed_bytes / 2**20:.1f} MiB on this rank; free space or choose another directory")
    return None


def problem_error(problem: str) -> Exception:
    """The named error for a problem `check_swap_root` returned."""
    return SwapSpaceError(problem) if " free but " in problem else SwapPathError(problem)


class SwapDirectory:
    """This rank's swap files: `<root>/<run>/rank<rank>/`, made on construction."""

    checksums = True  # [Note: swap checksums]; benchmarks/offload_bench.py turns it off to measure its cost

    def __init__(self, root: str | os.PathLike[str], run: str, rank: int):
        self.root = Path(root)
        self.path = self.root / run / f"rank{rank}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SwapPathError(f"cannot create the swap directory {str(self.path)!r}: {error.strerror}") from None
        self.counters = SwapCounters()
        self._lock = threading.Lock()  # the counters are updated from the I/O threads
        self._sums: dict[int, list[int]] = {}  # per file: the crc32 of each block, as written
        self._sizes: dict[int, int] = {}  # per file: its size, as written
        self.closed = False

    def file(self, index: int) -> Path:
        return self.path / f"subgroup{index:05d}.swp"

    def write(self, index: int, data: torch.Tensor) -> None:
        """Write `data` (contiguous, on the CPU) as sub-group `index`'s whole file."""
        self._write(index, data, 0, whole=True)

    def write_at(self, index: int, data: torch.Tensor, offset: int) -> None:
        """Write `data` into sub-group `index`'s file at byte `offset` (the file grows if shorter)."""
        self._write(index, data, offset, whole=False)

    def _write(self, index: int, data: torch.Tensor, offset: int, whole: bool) -> None:
        began = timeline.mark()
        view = _bytes_of(data)
        name = self.file(index)
        sums = self._sums_after_write(index, view, offset, whole) if self.checksums else None
        try:
            # Overwritten in place, not truncated first: the file's pages stay allocated (in the page
            # cache and on disk) from one step to the next instead of being freed and made again.
            fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], offset + written)
                if whole and os.fstat(fd).st_size > len(view):
                    os.ftruncate(fd, len(view))
            finally:
                os.close(fd)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SwapSpaceError(f"the disk under {str(self.root)!r} is full: writing {str(name)!r} "
                                     f"({len(view)} bytes) failed; free space or choose another nvme_path") from None
            raise SwapFileError(f"writing swap file {str(name)!r} failed: {error.strerror}") from None
        with self._lock:
            self.counters.bytes_written += len(view)
            self.counters.writes += 1
            if sums is not None:
                self._sums[index], self._sizes[index] = sums
        timeline.finish(began, "swap", "swap write", "swap", bytes=len(view))

    def read(self, index: int, out: torch.Tensor, offset: int = 0, whole: bool = True) -> None:
        """Fill `out` from sub-group `index`'s file at byte `offset`; `whole`: `out` is the whole
        file, whose size must then match exactly (a truncated or overlong file is an error). The
        blocks read are checked against their sums ([Note: swap checksums])."""
        began = timeline.mark()
        view = _bytes_of(out)
        self._read(index, view, offset, whole)
        with self._lock:
            self.counters.bytes_read += len(view)
            self.counters.reads += 1
        timeline.finish(began, "swap", "swap read", "swap", bytes=len(view))

    def _read(self, index: int, view: memoryview, offset: int, whole: bool) -> None:
        name = self.file(index)
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            raise SwapFileError(f"swap file {str(name)!r} is missing: the optimizer state it held is lost; resume "
                                "from the last checkpoint") from None
        try:
            size = os.fstat(fd).st_size
            written = self._sizes.get(index) if self.checksums else None
            if (whole and size != len(view)) or size < offset + len(view) or written not in (None, size):
                raise SwapFileError(f"swap file {str(name)!r} holds {size} bytes, expected "
                                    f"{written if written is not None else offset + len(view) if not whole else len(view)}"
                                    ": it was truncated or overwritten; resume from the last checkpoint")
            if written is None or not view:
                _pread(fd, name, view, offset)
            else:
                self._read_checked(fd, index, view, offset, size)
        finally:
            os.close(fd)

    def _read_checked(self, fd: int, index: int, view: memoryview, offset: int, size: int) -> None:
        """Read `view` at `offset` block by block, each block's sum checked as it arrives (a read not on
        block boundaries goes through a buffer of the whole blocks it touches)."""
        first, end = offset // _BLOCK * _BLOCK, min(-(-(offset + len(view)) // _BLOCK) * _BLOCK, size)
        target = view if (first, end) == (offset, offset + len(view)) else memoryview(bytearray(end - first))
        for low in range(0, len(target), _BLOCK):
            block = target[low: low + _BLOCK]
            _pread(fd, self.file(index), block, first + low)
            self._check(index, (first + low) // _BLOCK, block)
        if target is not view:
            view[:] = target[offset - first: offset - first + len(view)]

    def _check(self, index: int, number: int, block: memoryview) -> None:
        sums = self._sums[index]
        got = self._crc(block)
        if number >= len(sums) or got != sums[number]:
            low = number * _BLOCK
            raise SwapChecksumError(
                f"swap file {str(self.file(index))!r} changed since this engine wrote it: bytes {low}-{low + len(block)} "
                f"have crc32 {got:08x}, written {sums[number] if number < len(sums) else 0:08x} (an overwrite, a bit "
                "flip, or another swap file moved over it); the optimizer state it held is lost: resume from the "
                "last checkpoint")

    def _sums_after_write(self, index: int, view: memoryview, offset: int, whole: bool) -> tuple[list[int], int]:
        """The block sums and size of file `index` once `view` is written at `offset`: blocks the write
        covers only in part are read back (checked) and merged with it."""
        if whole:
            return [self._crc(view[low: low + _BLOCK]) for low in range(0, len(view), _BLOCK)], len(view)
        old_size = self._sizes.get(index, 0)
        sums = list(self._sums.get(index, []))
        size = max(old_size, offset + len(view))
        first, end = offset // _BLOCK * _BLOCK, min(-(-(offset + len(view)) // _BLOCK) * _BLOCK, size)
        merged = memoryview(bytearray(end - first))
        kept = min(end, old_size) - first
        if kept > 0 and (first < offset or offset + len(view) < first + kept):
            self._read(index, merged[:kept], first, whole=False)  # not counted: the engine did not ask for it
        merged[offset - first: offset - first + len(view)] = view
        sums.extend([0] * (-(-size // _BLOCK) - len(sums)))
        for low in range(0, len(merged), _BLOCK):
            sums[(first + low) // _BLOCK] = self._crc(merged[low: low + _BLOCK])
        return sums, size

    def _crc(self, block: memoryview) -> int:
        started = time.thread_time()  # CPU time: on a loaded machine wall time would count the waits for a core
        value = zlib.crc32(block)
        with self._lock:
            self.counters.checksum_s += time.thread_time() - started
        return value

    def close(self) -> None:
        """Remove this rank's swap files and directory (and the run's, once empty)."""
        if self.closed:
            return
        self.closed = True
        self._sums.clear()
        self._sizes.clear()
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()  # the last rank to close removes the run directory
        except OSError:
            pass


def _pread(fd: int, name: Path, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise SwapFileError(f"swap file {str(name)!r} ended early at {offset + done} bytes")
        done += got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "swap I/O takes contiguous CPU tensors"
    return tensor.view(-1).view(torch.uint8).numpy().data.cast("B")
