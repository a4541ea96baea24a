"""``zerodist config show``: a config as it will actually run."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from zerodist.config.schema import Config


def show_config(
    source: Config | Mapping[str, Any] | str | os.PathLike[str],
    *,
    world_size: int = 1,
    world_size_source: str = "--world-size",
) -> str:
    """The resolved config as indented JSON: defaults filled in, "auto" and batch sizes resolved.

    Raises ConfigError like ``Config.load``, and for a batch triple ``world_size`` cannot meet.
    """
    config = Config.load(source)
    batch = config.batch_sizes(world_size, world_size_source=world_size_source)
    resolved = config.to_dict()
    resolved["train_batch_size"] = batch.train_batch_size
    resolved["train_micro_batch_size_per_gpu"] = batch.micro_batch_size
    resolved["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
    return json.dumps(resolved, indent=2)
