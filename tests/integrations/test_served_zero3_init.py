"""The served `deepspeed.zero.Init` takes a config whose Trainer-filled `"auto"` values are not filled yet,
as axolotl hands it: its model loader builds a fresh `HfTrainerDeepSpeedConfig` of `zero3.json` with only
the batch sizes filled, and transformers' `from_pretrained` enters `deepspeed.zero.Init(config_dict_or_path=
that dict)` with `gradient_clipping`, `fp16.enabled`, `bf16.enabled` still `"auto"` ([Note: from_pretrained
under the served zero.Init] in zerodist/runtime/zero/served.py). Before, the served Init refused it:
`'gradient_clipping': "auto" is filled by Hugging Face's Trainer ..., and nothing fills it here`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerodist
from zerodist.config import ConfigError
from zerodist.config.auto import drop_trainer_auto
from zerodist.runtime.zero import served

pytestmark = pytest.mark.unit

TEMPLATE = Path(__file__).resolve().parents[1] / "config" / "templates" / "axolotl_zero3.json"


def axolotls_partly_filled_config() -> dict:
    config = json.loads(TEMPLATE.read_text())
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=4)
    return config


def test_trainer_auto_is_dropped_and_named():
    config, dropped = drop_trainer_auto(axolotls_partly_filled_config())
    assert set(dropped) == {"gradient_clipping", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
                            "zero_optimization.stage3_prefetch_bucket_size",
                            "zero_optimization.stage3_param_persistence_threshold"}
    assert "gradient_clipping" not in config and "enabled" not in config["fp16"] and config["fp16"]["loss_scale"] == 0
    assert config["zero_optimization"]["stage"] == 3 and config["train_batch_size"] == 4


def test_served_init_builds_under_a_config_the_trainer_has_not_filled_yet():
    config = axolotls_partly_filled_config()
    with served.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(4, 4)
    assert not layer.weight.is_meta  # built eagerly, as the served Init does
    assert config["gradient_clipping"] == "auto"  # the caller's dict is left as it was
    # zerodist's own Init still names what fills such an "auto": there no Trainer comes later.
    with pytest.raises(ConfigError, match="gradient_clipping"):
        zerodist.zero.Init(config_dict_or_path=config)
