"""A tiny Hugging Face Llama and GPT-2 (tied embeddings) built through transformers' own ZeRO-3 path
under `zerodist run --as-deepspeed`: `from_config` and `from_pretrained` enter the served
`deepspeed.zero.Init` and hold 1/world of the parameters per rank once built, with the values of the
same path built eagerly (initialisation and loaded checkpoint alike), and train bit for bit as it
does (tests/zero/zero_init_hf_script.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "zero" / "zero_init_hf_script.py"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_model_built_under_the_served_init_holds_a_shard_and_trains_as_the_eager_build(tmp_path, kind):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = [sys.executable, "-m", "zerodist", "run", "--as-deepspeed", "--nproc", "2", str(SCRIPT), "--out",
            str(tmp_path), "--kind", kind]
    result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["all_sharded"] and not measured["eager_sharded"]
        # per-parameter chunks: at most one padding element per parameter beyond an exact half
        assert measured["full_bytes"] / 2 <= measured["held_bytes"] <= measured["full_bytes"] / 2 + 4 * 64
        assert measured["loaded_held_bytes"] == measured["held_bytes"]
        assert measured["init_diff"] == 0.0 and measured["loaded_diff"] == 0.0
        assert measured["losses"] == measured["eager_losses"] and measured["train_diff"] == 0.0
        assert measured["tied"] == ([True, True] if kind == "gpt2" else [False, False])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainer_with_a_zero3_config_builds_under_the_served_init_and_logs_the_eager_builds_losses(tmp_path):
    """`TrainingArguments(deepspeed=ds_z3.json)` then `from_config`: the model is built partitioned,
    and `Trainer` logs the losses of the same script with the served Init building eagerly."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    runs = {}
    for mode in ("partitioned", "eager"):
        out = tmp_path / mode
        out.mkdir()
        args = [sys.executable, "-m", "zerodist", "run", "--as-deepspeed", "--nproc", "2", str(SCRIPT), "--out",
                str(out), "--kind", "llama", "--trainer", mode]
        result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[mode] = [json.loads((out / f"trainer{rank}.json").read_text()) for rank in range(2)]
    assert all(r["held_bytes"] > 0 for r in runs["partitioned"]) and all(r["held_bytes"] == 0 for r in runs["eager"])
    assert len(runs["eager"][0]["losses"]) == 3
    assert runs["partitioned"][0]["losses"] == runs["eager"][0]["losses"]
