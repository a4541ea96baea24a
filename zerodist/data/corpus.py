"""A byte corpus that every Python install already has, and fixed-length windows over it.

The standard library's ``*.py`` files give several megabytes of real, varied text with no
download and no disk cache, so the demo and the benchmarks run the same on an offline machine.
"""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from zerodist.utils import get_logger

logger = get_logger(__name__)

# Fewer bytes than this is not a standard library: a stripped install or a wrong ``root``.
MIN_CORPUS_BYTES = 100_000
# Between files; NUL never occurs in Python source, so the model can learn "a file ends here".
SEPARATOR = b"\x00"
# Installed packages are not the standard library, and the test suites are huge and repetitive.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def _python_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside the skipped directories, in sorted path order."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        found.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(found)


def stdlib_corpus(max_bytes: int = 8_000_000, seed: int = 0, *, root: str | os.PathLike | None = None) -> torch.Tensor:
    """The standard library's Python sources as one uint8 tensor of at most ``max_bytes``.

    Files are taken in sorted path order and then shuffled by ``random.Random(seed)``, so the
    corpus is deterministic per ``seed`` yet a truncated corpus is not just the alphabetically
    first packages. Files are joined by a NUL byte. ``root`` defaults to
    ``sysconfig.get_paths()["stdlib"]``. Raises ``FileNotFoundError`` if ``root`` has fewer
    than ``MIN_CORPUS_BYTES`` of sources and ``max_bytes`` asked for more than that.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = _python_files(root)
    random.Random(seed).shuffle(files)
    data = bytearray()
    for path in files:
        if len(data) >= max_bytes:
            break
        try:
            data += path.read_bytes() + SEPARATOR
        except OSError:  # an unreadable or vanished file: the corpus does not need it
            continue
    if len(data) < min(max_bytes, MIN_CORPUS_BYTES):
        raise FileNotFoundError(
            f"too little Python source under {root}: {len(data):,} bytes in {len(files)} *.py files, "
            f"need at least {MIN_CORPUS_BYTES:,} (is the standard library installed without sources?)"
        )
    del data[max_bytes:]
    logger.debug("stdlib corpus: %d bytes from %s (seed %d)", len(data), root, seed)
    return torch.frombuffer(data, dtype=torch.uint8)


def split_corpus(corpus: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the last ``val_fraction`` of the bytes is validation (views, no copy)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = max(1, int(len(corpus) * val_fraction))
    if num_val >= len(corpus):
        raise ValueError(f"corpus of {len(corpus)} bytes is too short to split")
    return corpus[:-num_val], corpus[-num_val:]


class TokenDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens: item ``i`` is ``(x, y)`` with
    ``x = corpus[i*L : i*L+L]`` and ``y = corpus[i*L+1 : i*L+L+1]`` (next-token targets), int64."""

    def __init__(self, corpus: torch.Tensor, seq_len: int) -> None:
        if corpus.dim() != 1:
            raise ValueError(f"corpus must be 1-D, got shape {tuple(corpus.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        # y reaches one token past x, so the last window needs seq_len + 1 tokens.
        self.num_windows = (len(corpus) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"corpus of {len(corpus)} tokens has no full window of seq_len={seq_len} (+1 target)")
        self.corpus = corpus
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_windows <= index < self.num_windows:
            raise IndexError(f"window {index} out of range for {self.num_windows} windows")
        start = (index % self.num_windows) * self.seq_len
        chunk = self.corpus[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]
