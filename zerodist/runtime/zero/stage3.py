"""``deepspeed.runtime.zero.stage3``: ``DeepSpeedZeroOptimizer_Stage3`` for ``isinstance``
(zerodist/engine/deepspeed_optimizers.py) and ``unwrap_model_for_generation``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from zerodist.engine.deepspeed_optimizers import DeepSpeedZeroOptimizer_Stage3
from zerodist.zero import GatheredParameters

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Inside, every parameter of the engine `model` is whole on every rank (gathered once, for
    generation's many forwards), as DeepSpeed's; all ranks enter it together. Unlike DeepSpeed, the
    engine's hooks stay: on a gathered unit they gather nothing. On exit the parameters are sharded
    again (changes made inside are discarded) and training goes on."""
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):
        yield model
