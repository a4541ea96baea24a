"""The base of every config section and the field types several sections share (kept apart from
schema.py so that a section in its own module can use them without importing the schema)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema


class Section(BaseModel):
    """Base of every section.

    strict: JSON ``"true"`` or ``1`` for a boolean, or ``"3"`` for a stage, is a mistake to
    report, not to coerce. allow_inf_nan: Python's json module accepts ``Infinity``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _reject_auto(value: Any) -> Any:
    # HF Trainer configs put "auto" inside optimizer params; only the Trainer's values fill it (auto.py).
    if isinstance(value, str) and value == "auto":
        raise ValueError("auto")
    return value


ConstructorArgument = Annotated[Any, AfterValidator(_reject_auto)]

# An element count that may also be "auto" (resolved to the field's default on validation).
# DeepSpeed configs write these as 5e8, which JSON parses as a float, so integral floats pass.
ElementCount = Annotated[
    int,
    Field(ge=0),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, {"const": "auto"}]}),
]

# A batch-size count; "auto" and absent (None) both mean "derive it" (see batch.py).
BatchCount = Annotated[
    Annotated[int, Field(ge=1)] | None,
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}, {"type": "null"}]}
    ),
]
