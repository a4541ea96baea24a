"""What an unknown config key does: refused (the default), or, by an explicit opt-in, ignored as DeepSpeed
ignores it, with one rank-0 warning each.

DeepSpeed reads its top level and its dict-parsed sections (``optimizer``, ``scheduler``, ``checkpoint``,
``pipeline``, ``flops_profiler``) key by key, so a misspelt key there (its own tests write
``"grandient_accumulation_steps"``) is silently dropped; its pydantic sections (``zero_optimization``,
``fp16``, ``bf16``, the monitors, ``comms_logger``, ``tensor_parallel``) refuse unknown keys, as does
zerodist's own ``zerodist`` section, and an optimizer's or scheduler's ``params`` reach a constructor
that refuses them. zerodist refuses every unknown key by default (a misspelling would otherwise change
the run silently). Runs served as DeepSpeed that must take configs written for DeepSpeed unchanged opt in
with ``ZERODIST_UNKNOWN_KEYS=warn`` or ``"zerodist": {"unknown_keys": "warn"}`` (the config's key wins):
an unknown key where DeepSpeed ignores it is then dropped, with one rank-0 warning that keeps the
"did you mean"; everywhere else it is still refused. Keys DeepSpeed knows and zerodist does not
implement, and DeepSpeed's old names, are refused under either policy: DeepSpeed would act on them.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from zerodist.config.deepspeed_keys import RENAMED, is_not_implemented
from zerodist.config.errors import ConfigError
from zerodist.config.problems import Location, dotted_path, validation_problems
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

ENV_VAR = "ZERODIST_UNKNOWN_KEYS"
POLICIES = ("error", "warn")
# The sections DeepSpeed parses key by key (unknown keys ignored); "" is the top level.
IGNORED_BY_DEEPSPEED_IN = frozenset({"", "optimizer", "scheduler", "checkpoint", "pipeline", "flops_profiler"})

Model = TypeVar("Model", bound=BaseModel)
_warned: set[str] = set()


def unknown_key_policy(raw: Mapping[str, Any], source: str | None = None) -> str:
    """``"error"`` or ``"warn"``: the config's ``zerodist.unknown_keys``, else ``ZERODIST_UNKNOWN_KEYS``, else
    ``"error"``. A bad environment value is a ConfigError naming the valid ones (a bad config value is left
    to the schema, which reports it with the config's other problems)."""
    section = raw.get("zerodist")
    if isinstance(section, Mapping) and section.get("unknown_keys") in POLICIES:
        return str(section["unknown_keys"])
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value and value not in POLICIES:
        raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: give 'error' (refuse unknown keys, the default) or "
                          "'warn' (ignore them where DeepSpeed does, with a warning)", source=source)
    return value or "error"


def validate(model: type[Model], raw: dict[str, Any], source: str | None = None) -> Model:
    """``model.model_validate(raw)``; under the "warn" policy, the unknown keys DeepSpeed ignores are dropped
    first (one warning each), and whatever else fails is raised as before (pydantic's ValidationError)."""
    policy = unknown_key_policy(raw, source)
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        if policy != "warn":
            raise
        ignorable = [tuple(detail["loc"]) for detail in error.errors() if _ignorable(detail)]
        if not ignorable:
            raise
        kept = copy.deepcopy(raw)
        for location in ignorable:
            _drop(kept, location)
        _warn(error, model, ignorable)
        return model.model_validate(kept)


def _ignorable(detail: Any) -> bool:
    if detail["type"] != "extra_forbidden":
        return False
    location: Location = tuple(detail["loc"])
    section, key = dotted_path(location[:-1]), str(location[-1])
    known_elsewhere = is_not_implemented(section, key) or (section, key) in RENAMED
    return section in IGNORED_BY_DEEPSPEED_IN and not known_elsewhere


def _drop(raw: dict[str, Any], location: Location) -> None:
    container: Any = raw
    for part in location[:-1]:
        container = container[part]
    container.pop(location[-1], None)


def _warn(error: ValidationError, model: type[BaseModel], ignorable: list[Location]) -> None:
    problems = validation_problems(error, model)
    locations = list(dict.fromkeys(tuple(detail["loc"]) for detail in error.errors()))
    for location, problem in zip(locations, problems, strict=True):
        if location in ignorable and problem not in _warned:
            _warned.add(problem)
            log_rank0(logger, "%s: ignored, as DeepSpeed ignores it (the unknown-key policy is 'warn'; the default, "
                      "'error', refuses it)", problem, level=logging.WARNING)
