"""The swap directory of one rank and the plain file I/O on it, with byte counters.

    <nvme_path>/<run>/rank<r>/subgroup<i>.swp     one file per sub-group ([Note: sub-groups] in
                                                   subgroups.py): each state kind's pieces, in order

Swap files are scratch, never checkpoints: `close()` removes them (the engine's `destroy()`
calls it); a process that dies leaves them for inspection, and the line logged when they were
made says where. Reads and writes are `os.preadv` / `os.pwrite` on a tensor's own memory (no
copy, and the GIL is released while the kernel copies), so the I/O threads of the pipelined
step overlap the optimizer's arithmetic. An async I/O library was not needed: on these machines
plain buffered I/O runs at memory speed until the page cache is full, and the pipeline hides it.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import threading
from pathlib import Path

import torch

from zerodist.comm import timeline
from zerodist.offload.errors import SwapFileError, SwapPathError, SwapSpaceError


@dataclasses.dataclass
class SwapCounters:
    """What this rank moved to and from its swap files, in bytes and calls, since it was made."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0

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

    def __init__(self, root: str | os.PathLike[str], run: str, rank: int):
        self.root = Path(root)
        self.path = self.root / run / f"rank{rank}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SwapPathError(f"cannot create the swap directory {str(self.path)!r}: {error.strerror}") from None
        self.counters = SwapCounters()
        self._lock = threading.Lock()  # the counters are updated from the I/O threads
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
        timeline.finish(began, "swap", "swap write", "swap", bytes=len(view))

    def read(self, index: int, out: torch.Tensor, offset: int = 0, whole: bool = True) -> None:
        """Fill `out` from sub-group `index`'s file at byte `offset`; `whole`: `out` is the whole
        file, whose size must then match exactly (a truncated or overlong file is an error)."""
        began = timeline.mark()
        view = _bytes_of(out)
        name = self.file(index)
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            raise SwapFileError(f"swap file {str(name)!r} is missing: the optimizer state it held is lost; resume "
                                "from the last checkpoint") from None
        try:
            size = os.fstat(fd).st_size
            if (whole and size != len(view)) or size < offset + len(view):
                raise SwapFileError(f"swap file {str(name)!r} holds {size} bytes, expected "
                                    f"{offset + len(view) if not whole else len(view)}: it was truncated or "
                                    "overwritten; resume from the last checkpoint")
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise SwapFileError(f"swap file {str(name)!r} ended early at {offset + done} bytes")
                done += got
        finally:
            os.close(fd)
        with self._lock:
            self.counters.bytes_read += len(view)
            self.counters.reads += 1
        timeline.finish(began, "swap", "swap read", "swap", bytes=len(view))

    def close(self) -> None:
        """Remove this rank's swap files and directory (and the run's, once empty)."""
        if self.closed:
            return
        self.closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()  # the last rank to close removes the run directory
        except OSError:
            pass


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "swap I/O takes contiguous CPU tensors"
    return tensor.view(-1).view(torch.uint8).numpy().data.cast("B")
