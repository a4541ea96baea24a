"""examples/hf_causal_lm.py end to end on 2 ranks: pretrained weights in, ZeRO-3 bf16 training with
checkpoints, save_pretrained out, loaded back by transformers."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.processes import run_group

pytestmark = pytest.mark.multiprocess

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_example_trains_a_pretrained_llama_and_saves_it_for_from_pretrained(tmp_path):
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(config)
    start.save_pretrained(tmp_path / "start")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", os.path.join(REPO, "examples", "hf_causal_lm.py"),
            "--model", str(tmp_path / "start"), "--out", str(out), "--steps", "4", "--save-interval", "2",
            "--seq-len", "32", "--micro-batch", "2", "--corpus-bytes", "200000"]
    result = run_group(args, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trained to step 4; from_pretrained('{out / 'hf'}')" in result.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("global_step")) == [
        "global_step2", "global_step4"]
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    trained = transformers.LlamaForCausalLM.from_pretrained(out / "hf", dtype="auto")
    assert all(p.dtype == torch.bfloat16 for p in trained.parameters())  # the training dtype, as DeepSpeed saves
    before, after = start.state_dict(), trained.state_dict()
    # started from the pretrained weights (not the model's fresh initialisation), then trained 4 steps
    for key in before:
        change = (after[key].float() - before[key]).abs().max().item()
        assert 0 < change < 0.05, (key, change)
