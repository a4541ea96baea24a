"""Pretrained weights into a stage-3 engine, each rank reading only the slices it owns."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config
from tests.harness import DistributedTestFailure, run_distributed
from tests.hf_models import hf_batch, hf_class, hf_config
from zerodist.checkpoint import load_pretrained

pytestmark = pytest.mark.multiprocess

pytest.importorskip("transformers")

# ~3.5M parameters: 4 layers of 256, large enough that the slices matter, small enough to be quick
MEDIUM = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 4}


def _load(path: str, precision: str):
    config = hf_config("llama", **MEDIUM)
    torch.manual_seed(1)  # another init than the saved model's: the load must replace every value
    with zerodist.zero.Init():
        model = hf_class("llama")(config)
    overrides = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(
        3, zero_optimization={"stage3_param_persistence_threshold": 0}, **overrides))
    report = load_pretrained(engine, path)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=hf_batch(7, 2)).logits
    full_bytes = sum(p.numel() for p in model.parameters()) * 4
    return logits, report, full_bytes, comm.get_rank()


@pytest.mark.parametrize("layout,precision", [("sharded-safetensors", "fp32"), ("torch-bin", "bf16")])
def test_load_pretrained_reads_only_owned_slices_and_matches_eager(tmp_path, layout, precision):
    torch.manual_seed(0)
    saved = hf_class("llama")(hf_config("llama", **MEDIUM))
    if layout == "sharded-safetensors":
        saved.save_pretrained(tmp_path, max_shard_size="2MB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
        source = tmp_path
    else:  # one torch file (a state dict), as torch.save writes it
        source = tmp_path / "weights.pt"
        torch.save(saved.state_dict(), source)
    results = run_distributed(_load, 2, str(source), precision)

    if layout == "sharded-safetensors":  # loaded the ordinary way, with nothing of zerodist
        eager = hf_class("llama").from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    else:
        eager = hf_class("llama")(hf_config("llama", **MEDIUM)).eval()
        eager.load_state_dict(torch.load(source, weights_only=True))
    if precision == "bf16":
        eager = eager.to(torch.bfloat16)
    with torch.no_grad():
        expected = eager(input_ids=hf_batch(7, 2)).logits
    for logits, report, full_bytes, rank in results:
        assert torch.equal(logits, expected), f"rank {rank}"
        assert len(report.files) == (1 if layout == "torch-bin" else len(set(report.files))) >= 1
        # each rank read its half of the parameters plus at most a row either side of each run:
        # what the load allocates (one run at a time) stays far under the fp32 model
        assert report.bytes_read < 0.6 * full_bytes, (report.bytes_read, full_bytes)
        assert report.largest_read < 0.1 * full_bytes


def _load_mismatched(path: str):
    with zerodist.zero.Init():
        model = hf_class("gpt2")(hf_config("gpt2"))
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(3))
    load_pretrained(engine, path)


def test_a_source_of_another_model_is_refused_on_every_rank(tmp_path):
    hf_class("llama")(hf_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_load_mismatched, 2, str(tmp_path))
    message = str(info.value)
    assert "failed on 2 of 2" in message
    assert "load_pretrained: the source does not match GPT2LMHeadModel's state_dict(): missing" in message
    assert "unexpected ['model.embed_tokens.weight'" in message
