"""A negative learning rate and a scheduler-parameter typo are validation errors (with a
did-you-mean), found before launch, not tracebacks on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from zerodist.config import Config, ConfigError
from zerodist.engine.optimizers import optimizer_from_config
from zerodist.engine.schedulers import scheduler_from_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_negative_learning_rate_is_a_config_error():
    config = Config.load({"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}})
    with pytest.raises(ConfigError, match="Invalid learning rate: -0.1"):
        optimizer_from_config(config)
    optimizer_from_config(Config.load({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["Adam", "AdamW", "adamw"])
def test_adam_without_weight_decay_decays_nothing_as_under_deepspeed(kind):
    """DeepSpeed's FusedAdam and DeepSpeedCPUAdam default weight_decay to 0; torch's AdamW to 0.01."""
    cls, params = optimizer_from_config(Config.load({"optimizer": {"type": kind, "params": {"lr": 0.1}}}))
    assert cls is torch.optim.AdamW and params == {"lr": 0.1, "weight_decay": 0.0}
    _, params = optimizer_from_config(Config.load({"optimizer": {"type": kind, "params": {"lr": 0.1,
                                                                                          "weight_decay": 0.1}}}))
    assert params["weight_decay"] == 0.1
    _, params = optimizer_from_config(Config.load({"optimizer": {"type": kind, "params": {"lr": 0.1,
                                                                                          "torch_adam": True}}}))
    assert params == {"lr": 0.1}  # torch's own class, with torch's defaults, as DeepSpeed's torch_adam gives


def test_a_scheduler_parameter_typo_says_did_you_mean():
    config = Config.load({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_step": 3}}})
    with pytest.raises(ConfigError, match=r"\['warmup_num_step'\] are not arguments of WarmupCosineLR \(did you "
                                          r"mean 'warmup_num_steps'\?\)"):
        scheduler_from_config(config)
    torch_config = Config.load({"scheduler": {"type": "StepLR", "params": {"step_sise": 3}}})
    with pytest.raises(ConfigError, match="did you mean 'step_size'"):
        scheduler_from_config(torch_config)


def test_zerodist_train_refuses_them_before_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "zerodist", "train", "--nproc", "2", "--lr", "-0.1", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Invalid learning rate: -0.1" in done.stderr, done.stderr[-2000:]
