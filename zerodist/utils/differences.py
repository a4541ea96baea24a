"""What differs between ranks' values, by name: for errors that must say which key or parameter
disagrees, not that two digests do."""

from __future__ import annotations

from typing import Any

_MISSING = "<absent>"
MAX_SHOWN = 8


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: `{"a": {"b": 1}}` -> `{"a.b": 1}`; other values stay whole."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def differing_entries(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per key whose value is not the same on every rank, naming each value's ranks:
    `optimizer.params.lr: 0.001 on rank(s) 0; 0.002 on rank(s) 1`. At most MAX_SHOWN lines."""
    keys = sorted(set().union(*per_rank))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            groups.setdefault(repr(values.get(key, _MISSING)), []).append(rank)
        if len(groups) > 1:
            lines.append(f"{key}: " + "; ".join(f"{value} on rank(s) {_ranks(ranks)}" for value, ranks in groups.items()))
    if len(lines) > MAX_SHOWN:
        lines = lines[:MAX_SHOWN] + [f"... and {len(lines) - MAX_SHOWN} more"]
    return lines


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
