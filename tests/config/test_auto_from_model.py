"""`"auto"` with plain `zerodist.initialize()` (no Trainer): the bucket sizes come from the model's
hidden size by the Trainer's formulas; a model without one keeps the defaults; every other "auto"
that only the Trainer fills stays an error naming what fills it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from zerodist.config import Config, ConfigError
from zerodist.utils.helpers import model_hidden_size

TEMPLATES = Path(__file__).parent / "templates"
HIDDEN = 24


class WithConfig(torch.nn.Module):
    """Stands for a Hugging Face model: a module with a `config.hidden_size`."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).mean()


def _buckets(stage: int) -> dict:
    return {"train_batch_size": 2, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}


@pytest.mark.unit
def test_hidden_size_is_read_as_transformers_reads_it():
    assert model_hidden_size(WithConfig()) == HIDDEN
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[8, 32, 16]))) == 32
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=5)))) == 5
    assert model_hidden_size(torch.nn.Linear(2, 2)) is None


@pytest.mark.unit
@pytest.mark.parametrize("stage", [2, 3])
def test_auto_bucket_sizes_follow_the_hidden_size(stage):
    zero = Config.load(_buckets(stage), hidden_size=HIDDEN).zero_optimization
    assert zero.reduce_bucket_size == HIDDEN**2
    defaults = Config.load({}).zero_optimization
    if stage == 3:  # the Trainer fills these at stage 3 only; below it the defaults apply, as there
        assert zero.stage3_prefetch_bucket_size == int(0.9 * HIDDEN**2)
        assert zero.stage3_param_persistence_threshold == 10 * HIDDEN
    else:
        assert zero.stage3_prefetch_bucket_size == defaults.stage3_prefetch_bucket_size
    without = Config.load(_buckets(stage)).zero_optimization  # no hidden size: the defaults
    assert without.reduce_bucket_size == defaults.reduce_bucket_size


@pytest.mark.unit
def test_auto_only_the_trainer_fills_is_still_named():
    raw = json.loads((TEMPLATES / "llamafactory_ds_z3_config.json").read_text())
    with pytest.raises(ConfigError) as caught:
        Config.load(raw, hidden_size=HIDDEN)
    named = [problem.split("'")[1] for problem in caught.value.problems]
    assert "gradient_clipping" in named
    assert not any("bucket" in key or "persistence" in key for key in named)


def _initialize_with_auto_buckets() -> tuple[int, int]:
    engine, *_ = zerodist.initialize(model=WithConfig(), config={
        **_buckets(3), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        zero = engine.config.zero_optimization
        return zero.reduce_bucket_size, zero.stage3_param_persistence_threshold
    finally:
        engine.destroy()


def test_initialize_fills_auto_bucket_sizes_from_the_model():
    assert run_distributed(_initialize_with_auto_buckets, 2, timeout=60) == [(HIDDEN**2, 10 * HIDDEN)] * 2
