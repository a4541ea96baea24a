"""The one exception the config layer raises, and how it shows a bad value."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# A value pasted into an error line is cut here so one line stays one line.
_MAX_VALUE_CHARS = 60


class ConfigError(ValueError):
    """Every problem found in one config, one line each.

    All problems are collected before raising so a user fixes a config in one round trip,
    not one key per run. ``problems`` keeps the lines for tests and tools.
    """

    def __init__(self, problems: str | Sequence[str], *, source: str | None = None) -> None:
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        header = "invalid zerodist config" + (f" {self.source}" if self.source else "")
        if len(self.problems) == 1:
            return f"{header}: {self.problems[0]}"
        lines = "".join(f"\n  - {problem}" for problem in self.problems)
        return f"{header}: {len(self.problems)} problems{lines}"


def show_value(value: Any) -> str:
    """A value as it would be written in the JSON config (``true``, ``"auto"``, ``5e8``)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."
