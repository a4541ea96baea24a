"""Top-level keys that spell a nested path with dots, as TRL's `prepare_deepspeed` writes them.

[Note: dotted keys] TRL prepares the reference model of DPO, GRPO and PPO at ZeRO-3 with
`config.update({"zero_optimization.reduce_bucket_size": h * h, "zero_optimization.stage3_param_persistence_threshold":
10 * h, "zero_optimization.stage3_prefetch_bucket_size": 0.9 * h * h})`. DeepSpeed reads its top level key
by key, so it drops these silently; zerodist refuses unknown keys, so the run stopped before training.
A dotted key whose path names a setting zerodist knows is read as that setting, which is what its
writer meant, with one info line on rank 0 (TRL's three tune buckets only; any other dotted setting
takes effect too, where DeepSpeed would run without it). A
non-integral number for an integer setting (0.9 * h * h) is rounded down. A dotted key that names no
setting stays unknown and is refused as any other; one that disagrees with the same setting given
nested is a problem naming both.
"""

from __future__ import annotations

import logging
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)


def expand_dotted_keys(raw: dict[str, Any], model: type[BaseModel]) -> tuple[dict[str, Any], list[str]]:
    """`raw` with each dotted top-level key that names a field of `model` moved to its nested place,
    and the problems (a dotted and a nested value that disagree)."""
    moved: list[str] = []
    problems: list[str] = []
    result = dict(raw)
    for key in [k for k in raw if isinstance(k, str) and "." in k]:
        path = key.split(".")
        annotation = _field(model, path)
        if annotation is None:
            continue  # names no setting: left to the unknown-key check, which refuses it by name
        value = raw[key]
        if isinstance(value, float) and not value.is_integer() and _is_integer(annotation):
            value = math.floor(value)
        target = result
        for part in path[:-1]:
            inner = target.get(part)
            if not isinstance(inner, Mapping):
                inner = {}
            target[part] = inner = dict(inner)
            target = inner
        if path[-1] in target and target[path[-1]] != value:
            nested = "".join(f"{{{part!r}: " for part in path) + repr(target[path[-1]]) + "}" * len(path)
            problems.append(f"the top-level key '{key}' ({raw[key]!r}) and {nested} are one setting with two "
                            "values; give one")
            continue
        target[path[-1]] = value
        del result[key]
        moved.append(f"{key}={value!r}" + (f" (from {raw[key]!r}, rounded down)" if value != raw[key] else ""))
    if moved:
        log_rank0(logger, "config: read dotted keys as nested settings (as TRL's prepare_deepspeed writes them; "
                  "DeepSpeed drops them): %s", ", ".join(moved), level=logging.INFO)
    return result, problems


def _field(model: type[BaseModel], path: list[str]) -> Any | None:
    """The annotation of the field `path` names under `model` (by name or alias), or None."""
    current: Any = model
    annotation: Any = None
    for part in path:
        section = _model_in(current)
        if section is None:
            return None
        fields = {**section.model_fields, **{f.alias: f for f in section.model_fields.values() if f.alias}}
        if part not in fields:
            return None
        annotation = fields[part].annotation
        current = annotation
    return annotation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or inside Optional / a union), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_integer(annotation: Any) -> bool:
    """Whether the field takes integers and no other number (bool aside)."""
    args = set(_flatten(annotation))
    return int in args and float not in args


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [t for arg in typing.get_args(annotation) for t in _flatten(arg)]
    return [annotation]
