"""The values of `optimizer.params` and `scheduler.params`, checked against the types of the class's
constructor (its annotations, else its defaults) before anything is built.

The schema types these dicts as free keyword arguments (which keys exist depends on the class the
`type` names); the engine resolves the class and asks here, before spawn in `zerodist train` and at
`initialize()`. Without this, `"lr": true` trained (torch takes a bool as 1), `"betas": [0.9]` was
an IndexError traceback and `"warmup_num_steps": "ten"` Python's "'>' not supported between
instances of 'str' and 'int'", neither naming the key.

An annotation is read as text (torch's are objects, the DeepSpeed schedules' are strings): its
alternatives `bool`, `int`, `float`, `str`, `None`, `tuple[...]`, `list[...]`, `Literal[...]` are
checked; a tensor alternative is ignored (JSON has none) and an annotation this does not know
accepts anything, so an unusual signature never blocks a valid config.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any


def argument_problems(prefix: str, cls: type, params: Mapping[str, Any]) -> list[str]:
    """One line per value of `params` whose type `cls`'s constructor does not take, each naming the
    key as `<prefix>.<key>`; keys that are not arguments are left to the caller's unknown-key check."""
    try:
        signature = inspect.signature(getattr(cls, "__init__"))
    except (TypeError, ValueError):
        return []
    problems = []
    for key, value in params.items():
        parameter = signature.parameters.get(key)
        if parameter is None:
            continue
        expected = _expected(parameter)
        if expected is None or _matches(value, expected):
            continue
        problems.append(f"{prefix}.{key}: {_show(value)} is not {_describe(expected)} "
                        f"({cls.__name__}'s {key} is {_annotation_text(parameter) or type(parameter.default).__name__})")
    return problems


# An expected type: ("bool",), ("int",), ("number",), ("str",), ("none",), ("choice", values),
# ("tuple", [element alternatives...]), ("list", element alternatives), or ("union", [alternatives]).
Expected = tuple[Any, ...]


def _annotation_text(parameter: inspect.Parameter) -> str:
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _expected(parameter: inspect.Parameter) -> Expected | None:
    text = _annotation_text(parameter)
    if text:
        return _parse(text.strip())
    default = parameter.default
    if isinstance(default, bool):
        return ("bool",)
    if isinstance(default, (int, float)):
        return ("number",)
    if isinstance(default, str):
        return ("str",)
    return None


def _split(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[(" and 1 or 0
        depth -= char in "])" and 1 or 0
        if char == separator and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def _parse(text: str) -> Expected | None:
    """The expected type an annotation's text says, or None (anything goes)."""
    for wrapper in ("Optional[", "Union["):
        if text.startswith(wrapper) and text.endswith("]"):
            inner = _split(text[len(wrapper):-1], ",")
            text = " | ".join(inner + (["None"] if wrapper == "Optional[" else []))
    alternatives = _split(text, "|")
    if len(alternatives) > 1:
        parsed = [_parse(a) for a in alternatives if a not in ("Tensor", "torch.Tensor")]
        return None if any(p is None for p in parsed) else ("union", parsed)
    simple = {"bool": ("bool",), "int": ("int",), "float": ("number",), "str": ("str",), "None": ("none",),
              "NoneType": ("none",)}
    if text in simple:
        return simple[text]
    for name, kind in (("tuple[", "tuple"), ("Tuple[", "tuple"), ("list[", "list"), ("List[", "list")):
        if text.startswith(name) and text.endswith("]"):
            elements = [_parse(e) for e in _split(text[len(name):-1], ",")]
            if any(e is None for e in elements) or "..." in text:
                return None
            return (kind, elements) if kind == "tuple" else ("list", ("union", elements))
    if text.startswith("Literal[") and text.endswith("]"):
        try:
            return ("choice", [json.loads(v.replace("'", '"')) for v in _split(text[8:-1], ",")])
        except ValueError:
            return None
    return None


def _matches(value: Any, expected: Expected) -> bool:
    kind = expected[0]
    if kind == "union":
        return any(_matches(value, e) for e in expected[1])
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "none":
        return value is None
    if kind == "choice":
        return value in expected[1]
    if kind == "tuple":
        return isinstance(value, (list, tuple)) and len(value) == len(expected[1]) and all(
            _matches(v, e) for v, e in zip(value, expected[1]))
    if kind == "list":
        return isinstance(value, (list, tuple)) and all(_matches(v, expected[1]) for v in value)
    return True


def _describe(expected: Expected) -> str:
    kind = expected[0]
    if kind == "union":
        return " or ".join(dict.fromkeys(_describe(e) for e in expected[1]))
    if kind == "tuple":
        elements = list(dict.fromkeys(_describe(e).removeprefix("a ").removeprefix("an ") for e in expected[1]))
        return f"a list of {len(expected[1])} {elements[0] if len(elements) == 1 else 'values'}" + (
            "s" if len(elements) == 1 and not elements[0].endswith("s") else "")
    if kind == "list":
        return f"a list of ({_describe(expected[1])})"
    if kind == "choice":
        return "one of " + ", ".join(json.dumps(c) for c in expected[1])
    return {"bool": "true or false", "int": "an integer", "number": "a number", "str": "a string",
            "none": "null"}[kind]


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
