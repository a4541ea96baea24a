"""Top-level dotted keys ([Note: dotted keys] in zerodist/config/dotted_keys.py): TRL's prepare_deepspeed
tunes the ZeRO-3 reference model with them. They are read as the nested settings they name; anything
else about them is refused by name."""

from __future__ import annotations

import pytest

import zerodist

pytestmark = pytest.mark.unit

HIDDEN = 64


def _trl_reference_config(stage: int = 3) -> dict:
    """What TRL 1.16's prepare_deepspeed passes to deepspeed.initialize for a hidden size of 64."""
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    config.update({"zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
                   "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
                   "zero_optimization.stage3_prefetch_bucket_size": 0.9 * HIDDEN * HIDDEN})
    return config


def test_trls_reference_config_is_read_as_nested_settings():
    zero = zerodist.Config.load(_trl_reference_config()).zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_prefetch_bucket_size) == (3, 4096, 640, 3686)  # 0.9 * 64 * 64 = 3686.4, rounded down


def test_a_dotted_key_that_names_no_setting_is_refused():
    with pytest.raises(zerodist.ConfigError, match="unknown key 'zero_optimization.reduce_bucket_sizee'"):
        zerodist.Config.load({"zero_optimization.reduce_bucket_sizee": 5})
    with pytest.raises(zerodist.ConfigError, match="unknown key 'optimizer.params.lr'"):  # a free-form dict: no field
        zerodist.Config.load({"optimizer": {"type": "AdamW"}, "optimizer.params.lr": 0.5})


def test_a_dotted_and_a_nested_value_that_disagree_are_refused_and_equal_ones_agree():
    with pytest.raises(zerodist.ConfigError, match="one setting with two values"):
        zerodist.Config.load({"zero_optimization": {"reduce_bucket_size": 3}, "zero_optimization.reduce_bucket_size": 5})
    config = zerodist.Config.load({"zero_optimization": {"reduce_bucket_size": 5}, "zero_optimization.reduce_bucket_size": 5})
    assert config.zero_optimization.reduce_bucket_size == 5


def test_a_non_integral_number_is_rounded_down_only_for_an_integer_setting():
    fp16 = zerodist.Config.load({"fp16.enabled": True, "fp16.min_loss_scale": 0.25}).fp16
    assert fp16.enabled is True and fp16.min_loss_scale == 0.25  # a float setting keeps its value
