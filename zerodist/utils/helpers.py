"""Small pure helpers shared by every layer."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` when none is close."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def format_bytes(num_bytes: float) -> str:
    """Binary units with three significant digits: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_int_env(environ: dict[str, str], name: str) -> int | None:
    """The integer value of ``environ[name]``; None when unset; ValueError naming the variable."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def model_hidden_size(model: Any) -> int | None:
    """A model's hidden size as transformers reads it for "auto" bucket sizes: its ``config``'s
    ``hidden_size`` (the largest of ``hidden_sizes``; a multimodal model's ``text_config``'s); None
    when it has none (a plain ``nn.Module``)."""
    config = getattr(model, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        if owner is None:
            continue
        size = getattr(owner, "hidden_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
        sizes = getattr(owner, "hidden_sizes", None)
        if sizes and all(isinstance(s, int) for s in sizes):
            return max(sizes)
    return None
