"""Read what ``Config.load`` is given into a plain dict: a dict, or a path to a JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerodist.config.errors import ConfigError


def read_source(
    source: Mapping[str, Any] | str | os.PathLike[str],
) -> tuple[dict[str, Any], str | None]:
    """The raw config and a name for it in errors (the path; None for a dict)."""
    if isinstance(source, Mapping):
        return dict(source), None
    if isinstance(source, (str, os.PathLike)):
        return read_json_file(Path(source)), str(source)
    raise ConfigError(
        f"a config must be a dict, a path to a JSON file or a Config, got {type(source).__name__}"
    )


def read_json_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"cannot read the file: {reason}", source=str(path)) from None
    duplicates: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _keep_pairs(pairs, duplicates))
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}",
            source=str(path),
        ) from None
    if duplicates:
        # json keeps the last of two equal keys; the first one would be silently ignored.
        raise ConfigError(
            [f"key '{key}' appears twice in one JSON object" for key in duplicates],
            source=str(path),
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a JSON object, got {_json_kind(data)}", source=str(path)
        )
    return data


def _keep_pairs(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            duplicates.append(key)
        result[key] = value
    return result


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true or false"
    return "null" if value is None else "a number"
