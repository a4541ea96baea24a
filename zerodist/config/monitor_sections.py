"""DeepSpeed's `wandb` and `comet` monitor sections, with DeepSpeed's keys and defaults
(zerodist/engine/monitor.py writes them; docs/monitor.md). `csv_monitor` and `tensorboard` are
`MonitorConfig` in schema.py.

Each checks, when enabled, that its package is importable (without importing it), so a missing
package is an error naming the key and the `pip install` at config load, on every rank before
anything runs."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field

from zerodist.config.fields import Section


class WandbConfig(Section):
    enabled: bool = Field(
        False, description="Log loss, learning rate and (under fp16) loss scale to Weights & Biases from rank 0, "
        "against the samples seen (needs pip install wandb; WANDB_MODE=offline writes the run locally)."
    )
    group: str | None = Field(None, description="The W&B group of the run (wandb.init's group).")
    team: str | None = Field(None, description="The W&B team (wandb.init's entity).")
    project: str = Field("deepspeed", description="The W&B project.")



class CometConfig(Section):
    enabled: bool = Field(
        False, description="Log loss, learning rate and (under fp16) loss scale to Comet from rank 0, against the "
        "samples seen (needs pip install comet_ml; online: false keeps an offline experiment, written where "
        "COMET_OFFLINE_DIRECTORY says)."
    )
    samples_log_interval: int = Field(
        100, ge=1, description="An event is logged once at least this many samples have passed since it last was."
    )
    project: str | None = Field(None, description="Comet project (or COMET_PROJECT_NAME).")
    workspace: str | None = Field(None, description="Comet workspace (or COMET_WORKSPACE).")
    api_key: str | None = Field(None, description="Comet API key (or COMET_API_KEY); an offline experiment needs none.")
    experiment_name: str | None = Field(None, description="The experiment's name.")
    experiment_key: str | None = Field(
        None, description="The experiment's key (32 to 50 alphanumeric characters), to log to a given experiment."
    )
    online: bool | None = Field(
        None, description="false: an offline experiment, uploaded later with comet upload; null or true: the "
        "Comet server."
    )
    mode: Literal["get", "create", "get_or_create"] | None = Field(
        None, description="comet_ml.start's mode: get, create or get_or_create (default)."
    )


def check_monitor_packages(wandb: WandbConfig, comet: CometConfig) -> None:
    """The config's check (a model validator of Config): an enabled section's package is importable."""
    for key, section, package in (("wandb", wandb, "wandb"), ("comet", comet, "comet_ml")):
        if section.enabled and importlib.util.find_spec(package) is None:
            raise ValueError(f"'{key}.enabled' needs the {package} package, which is not installed here: pip install "
                             f"{package} (or pip install 'zerodist[monitors]'), or set '{key}.enabled' to false")
