"""Whole weights out of an engine: `save_16bit_model` and a `save_pretrained` directory."""

from __future__ import annotations

import json

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config
from tests.harness import run_distributed
from tests.hf_models import hf_batch, hf_class, hf_config, hf_loss

pytestmark = pytest.mark.multiprocess

pytest.importorskip("transformers")


def _trained_engine(kind: str, stage: int, **overrides):
    torch.manual_seed(5)
    with zerodist.zero.Init():
        model = hf_class(kind)(hf_config(kind))
    config = base_config(stage, zero_optimization={"stage3_param_persistence_threshold": 0}, **overrides)
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    rank, micro = comm.get_rank(), engine.batch.micro_batch_size
    for step in range(2):
        ids = hf_batch(step, micro * comm.get_world_size())[rank * micro:(rank + 1) * micro]
        engine.backward(hf_loss(engine, ids))
        engine.step()
    return engine


def _save_pretrained(kind: str, stage: int, path: str, max_shard_size: str):
    engine = _trained_engine(kind, stage)
    zerodist.checkpoint.save_pretrained(engine, path, max_shard_size=max_shard_size)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=hf_batch(99, 3)).logits
    return logits, engine.module_state_dict()


@pytest.mark.parametrize("kind,stage,shard", [("gpt2", 3, "20KB"), ("llama", 3, "5GB"), ("bert", 1, "20KB")])
def test_save_pretrained_loads_with_from_pretrained(tmp_path, kind, stage, shard):
    """Saved from 2 ranks (stage 3: one gather per unit), loaded by transformers in this process
    with nothing of zerodist: the same logits, bitwise, and the same weights."""
    results = run_distributed(_save_pretrained, 2, kind, stage, str(tmp_path), shard)
    logits, state = results[0]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "config.json" in files
    if shard == "20KB":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and all(name in files for name in shards)
    else:
        assert "model.safetensors" in files
    loaded = hf_class(kind).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf_class(kind).__name__]
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=hf_batch(99, 3)).logits, logits)


def _save_16bit(path: str, name: str):
    engine = _trained_engine("gpt2", 3, bf16={"enabled": True})
    assert engine.save_16bit_model(path, name) is True
    return engine.module_state_dict()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_save_16bit_model_at_stage_3(tmp_path, name):
    state = run_distributed(_save_16bit, 2, str(tmp_path), name)[0]
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        saved = load_file(tmp_path / name)
    else:
        saved = torch.load(tmp_path / name, weights_only=True)
    assert sorted(saved) == sorted(state)  # every key, tied ones included
    if name.endswith(".bin"):
        assert list(saved) == list(state)  # in state_dict order
    for key, value in state.items():
        assert saved[key].dtype == (torch.bfloat16 if value.is_floating_point() else value.dtype), key
        assert torch.equal(saved[key], value), key
    model = hf_class("gpt2")(hf_config("gpt2")).to(torch.bfloat16)
    model.load_state_dict(saved, strict=True)
