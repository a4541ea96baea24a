"""Bytes on disk: atomic files with checksums, verified and ranged reads, and the crash points.

[Note: atomic files] Every file is written under a hidden temporary name in its final
directory, flushed, fsynced, renamed to its final name, and the directory is fsynced after the
rename. After a crash at any instant a final name therefore either does not exist or holds its
complete contents: POSIX rename is atomic, and the data reached the disk before the name did.

Checksums are CRC-32 (zlib), computed while writing from the very buffers written. They guard
against truncation and corruption (a bad disk, a copy cut short), not against tampering; at
several GB/s they cost little beside the write itself.
"""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path
from typing import Any

import torch

from zerodist.checkpoint.errors import CheckpointCorruptError

CHUNK_BYTES = 16 << 20
KILL_ENV = "ZERODIST_CHECKPOINT_TEST_KILL_AT"

# Every point inside a save where the crash tests kill a rank (in the order a save passes them).
# `ZERODIST_CHECKPOINT_TEST_KILL_AT=<point>` or `<point>@<rank>` makes that rank SIGKILL itself there.
KILL_POINTS = (
    "save-start", "tag-agreed", "shard-opened", "shard-partial", "shard-written", "shard-synced",
    "shard-renamed", "state-written", "state-synced", "state-renamed", "before-gather", "after-gather",
    "manifest-written", "manifest-synced", "manifest-renamed", "manifest-committed", "latest-written",
    "latest-synced", "latest-renamed", "cleanup-started", "cleanup-partial", "before-outcome", "save-done",
)


def kill_point(name: str) -> None:
    """Test hook: SIGKILL this process here when `KILL_ENV` names this point (and this rank)."""
    assert name in KILL_POINTS, f"unknown kill point {name!r}"
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, rank = spec.partition("@")
    if point == name and (not rank or rank == os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is a contiguous CPU tensor."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    # numpy arrays have the buffer protocol; typeshed spells it __buffer__, which numpy declares from 3.12 only.
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def checksum_text(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """A file written under a temporary name and renamed when complete ([Note: atomic files]).

    `write()` returns the offset the data landed at; `commit()` makes the file appear under its
    final name; leaving the `with` block without committing removes the temporary file."""

    def __init__(self, path: Path, points: str | None = None):
        self.path, self.points = Path(path), points
        self.temp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.nbytes, self.crc = 0, 0
        self._file: Any = open(self.temp, "wb")
        self.committed = False

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.committed:
            self.discard()

    def write(self, data: bytes | memoryview) -> int:
        offset = self.nbytes
        self._file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.nbytes += memoryview(data).nbytes
        return offset

    def _point(self, suffix: str) -> None:
        if self.points:
            kill_point(f"{self.points}-{suffix}")

    def commit(self) -> None:
        self._file.flush()
        self._point("written")
        os.fsync(self._file.fileno())
        self._file.close()
        self._point("synced")
        os.replace(self.temp, self.path)
        self.committed = True
        self._point("renamed")
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        try:
            self._file.close()
        finally:
            self.temp.unlink(missing_ok=True)

    @property
    def checksum(self) -> str:
        return checksum_text(self.crc)


def write_atomic(path: Path, data: bytes, points: str | None = None) -> tuple[int, str]:
    """Write `data` to `path` atomically; returns (bytes, checksum)."""
    with AtomicFile(path, points) as out:
        out.write(data)
        out.commit()
    return out.nbytes, out.checksum


def file_problem(path: Path, expected_bytes: int, expected_checksum: str) -> str | None:
    """Why `path` is not the file the manifest describes, or None when it is."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing"
    if size != expected_bytes:
        return f"{path}: {'truncated' if size < expected_bytes else 'too long'}, {size} bytes instead of {expected_bytes}"
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(min(CHUNK_BYTES, max(1, size)))
        view = memoryview(buffer)
        while True:
            n = f.readinto(view)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    if checksum_text(crc) != expected_checksum:
        return f"{path}: corrupt, CRC-32 {checksum_text(crc)} instead of {expected_checksum}"
    return None


def read_verified(path: Path, expected_bytes: int, expected_checksum: str) -> bytes:
    """The whole file, after checking its size and checksum (small files: per-rank state)."""
    problem = None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        problem = f"{path}: missing"
    else:
        if len(data) != expected_bytes:
            problem = f"{path}: truncated, {len(data)} bytes instead of {expected_bytes}"
        elif checksum_text(zlib.crc32(data)) != expected_checksum:
            problem = f"{path}: corrupt, CRC-32 {checksum_text(zlib.crc32(data))} instead of {expected_checksum}"
    if problem:
        raise CheckpointCorruptError(f"checkpoint file {problem}")
    return data


class RangeReader:
    """Reads byte ranges of checkpoint files straight into tensors (files opened once)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[str, Any] = {}

    def read_into(self, name: str, offset: int, out: torch.Tensor) -> None:
        """Fill the 1-D tensor `out` from `name` at byte `offset` (same dtype as stored)."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.directory / name, "rb", buffering=0)
        target = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty_like(out, device="cpu")
        view = memoryview(target.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # as in tensor_bytes
        f.seek(offset)
        done = 0
        while done < view.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointCorruptError(f"checkpoint file {self.directory / name}: ends at byte {offset + done}, "
                                             f"{view.nbytes - done} bytes short")
            done += n
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
