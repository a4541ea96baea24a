"""Turn pydantic's ValidationError into one plain line per problem.

pydantic's own text names internal types and union branches; users wrote JSON, so each line
names the dotted key (``zero_optimization.stage``), the value as JSON, and what the schema
accepts, described from the same JSON schema the docs are generated from.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from zerodist.config.auto import trainer_source
from zerodist.config.deepspeed_keys import NOT_IMPLEMENTED, RENAMED, is_not_implemented, not_implemented_message
from zerodist.config.errors import show_value
from zerodist.utils import did_you_mean

Location = tuple[int | str, ...]


def validation_problems(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per failing location (its first error: a union can report several)."""
    problems: dict[Location, str] = {}
    for detail in error.errors():
        location = tuple(detail["loc"])
        if location not in problems:
            problems[location] = _problem(detail, root)
    return list(problems.values())


def _problem(detail: Any, root: type[BaseModel]) -> str:
    location, value = tuple(detail["loc"]), detail["input"]
    if not location:
        # A model-level check: its message is already written for users.
        return str(detail["msg"]).removeprefix("Value error, ")
    path = dotted_path(location)
    if detail["type"] == "extra_forbidden":
        return _unknown_key_problem(location, root)
    expected = describe_schema(_schema_at(root, location))
    if detail["type"] == "missing":
        return f"missing required key '{path}' ({expected})"
    if isinstance(value, str) and value == "auto":
        return _auto_problem(path, expected)
    return f"'{path}': got {show_value(value)}; expected {expected}"


def _auto_problem(path: str, expected: str) -> str:
    source = trainer_source(path)
    if source is None:
        return f"'{path}': \"auto\" cannot be resolved by zerodist; give {expected}"
    # A Trainer template used without the Trainer: say what fills it there, and both ways out.
    return (f"'{path}': \"auto\" is filled by Hugging Face's Trainer (from {source}), and nothing fills it "
            f"here; give {expected}, or train with zerodist.integrations.transformers.ZerodistTrainer")


def _unknown_key_problem(location: Location, root: type[BaseModel]) -> str:
    section_location, key = location[:-1], str(location[-1])
    section = dotted_path(section_location)
    path = dotted_path(location)
    if is_not_implemented(section, key):
        return not_implemented_message(path, section, key)
    if (section, key) in RENAMED:
        return f"'{path}' is DeepSpeed's old name for '{RENAMED[section, key]}'; rename it"
    valid_keys = list(model_at(root, section_location).model_fields)
    # A misspelt DeepSpeed key is suggested too (`cpu_ofload` -> `cpu_offload`), so that its own
    # message (refused, or accepted with a value that changes nothing) follows the fix.
    hint = did_you_mean(key, valid_keys + list(NOT_IMPLEMENTED.get(section, ())))
    if hint:
        return f"unknown key '{path}'{hint}"
    where = f" in '{section}'" if section else ""
    return f"unknown key '{path}'; valid keys{where}: {', '.join(valid_keys)}"


def dotted_path(location: Location) -> str:
    """``("zero_optimization", "stage")`` -> ``zero_optimization.stage``; indexes as ``[0]``."""
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section model in a field's annotation (``Fp16Config``, ``OptimizerConfig | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            found = nested_model(member)
            if found is not None:
                return found
    return None


def model_at(root: type[BaseModel], section_location: Location) -> type[BaseModel]:
    """The model class of the section at ``section_location`` (``()`` is ``root``)."""
    model = root
    for name in section_location:
        nested = nested_model(model.model_fields[str(name)].annotation)
        assert nested is not None, f"{dotted_path(section_location)} is not a section"
        model = nested
    return model


@functools.cache
def field_schemas(model: type[BaseModel]) -> dict[str, Any]:
    """JSON schema of each field of ``model``: the single source for error text and docs."""
    return model.model_json_schema()["properties"]


def _schema_at(root: type[BaseModel], location: Location) -> dict[str, Any]:
    model, index = root, 0
    # Walk down sections until the field that failed; what is left indexes into its value.
    while True:
        name = str(location[index])
        if name not in model.model_fields:
            return {}
        nested = nested_model(model.model_fields[name].annotation)
        if nested is None or index == len(location) - 1:
            break
        model, index = nested, index + 1
    schema = field_schemas(model)[name]
    for part in location[index + 1 :]:
        schema = schema.get("items" if isinstance(part, int) else "additionalProperties", {})
        schema = schema if isinstance(schema, dict) else {}
    return schema


def describe_schema(schema: dict[str, Any]) -> str:
    """What a JSON schema accepts, in words: ``an integer from 0 to 3``, ``"auto"``, ``null``."""
    if "anyOf" in schema:
        return _join_or([describe_schema(member) for member in schema["anyOf"]])
    if "$ref" in schema:
        return "an object"
    if "const" in schema:
        return show_value(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(show_value(member) for member in schema["enum"])
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return ("an integer" if kind == "integer" else "a number") + _describe_range(schema)
    if kind == "array":
        item_kind = schema.get("items", {}).get("type")
        return "a list of " + {"string": "strings", "integer": "integers", "number": "numbers"}.get(
            item_kind, "values"
        )
    simple: dict[str | None, str] = {
        "boolean": "true or false",
        "string": "a string",
        "object": "an object",
        "null": "null",
    }
    if kind == "string" and schema.get("minLength"):
        return "a non-empty string"
    return simple.get(kind, "a concrete value")


def _describe_range(schema: dict[str, Any]) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None:
        return f" from {json.dumps(low)} to {json.dumps(high)}"
    if low is not None:
        return f" >= {json.dumps(low)}"
    if schema.get("exclusiveMinimum") is not None:
        return f" > {json.dumps(schema['exclusiveMinimum'])}"
    return ""


def _join_or(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " or " + phrases[-1]
