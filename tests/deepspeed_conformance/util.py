"""zerodist's stand-in for the two helpers of DeepSpeed's ``tests/unit/util.py`` the fetched files use
(copied into the work directory as ``unit/util.py`` by run.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def skip_on_arch(min_arch: int = 7) -> None:
    """DeepSpeed skips below a CUDA compute capability; nothing to skip on the CPU."""
    return None


def skip_on_cuda(valid_cuda: Any) -> None:
    return None


@contextlib.contextmanager
def no_child_process_in_deepspeed_io() -> Iterator[None]:
    yield
