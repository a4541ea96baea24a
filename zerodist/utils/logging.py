"""Rank-aware logging.

Every record carries ``[rank R]`` so interleaved output from many ranks can be told apart.
The rank is read from the launcher's environment (``RANK``), which every launcher we support
sets before Python starts, so this layer needs nothing from ``zerodist.comm``.
``log_rank0`` logs on rank 0 only: use it for messages every rank would repeat.
"""

from __future__ import annotations

import logging
import os

_ROOT = "zerodist"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(_configure_root, "done", False):
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[zerodist %(levelname)s rank %(rank)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("ZERODIST_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _configure_root.done = True  # type: ignore[attr-defined]
    return root


def get_logger(name: str) -> logging.Logger:
    """A child of the ``zerodist`` logger (``get_logger(__name__)``)."""
    _configure_root()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def log_rank0(logger: logging.Logger, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log on rank 0 only (by the launcher's ``RANK``; a one-process world is rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        logger.log(level, message, *args)
