"""DeepSpeed's `deepspeed.runtime` names that scripts reach for, so `import zerodist as deepspeed`
runs them: `deepspeed.runtime.utils.set_random_seed` (DeepSpeedExamples' pipeline example),
`deepspeed.runtime.lr_schedules`, `deepspeed.runtime.engine.DeepSpeedEngine`, `deepspeed.runtime.pipe`,
`deepspeed.runtime.activation_checkpointing`, `deepspeed.runtime.sequence_parallel` (each imported on
first use, as attributes after a bare import, as in DeepSpeed)."""

from __future__ import annotations

import importlib
from typing import Any

from zerodist.runtime import utils

__all__ = ["utils"]

_SUBMODULES = {"lr_schedules", "engine", "pipe", "activation_checkpointing", "sequence_parallel", "zero", "config"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
