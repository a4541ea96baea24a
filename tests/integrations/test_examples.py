"""examples/hf_trainer.py and examples/lightning_strategy.py as users launch them: `zerodist run --nproc 2`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]


def launch(example: str, out: Path) -> str:
    args = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", str(REPO / "examples" / example),
            "--out", str(out)]
    result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_hf_trainer_example_trains_llamafactorys_zero3_template_and_saves_for_from_pretrained(tmp_path):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    stdout = launch("hf_trainer.py", tmp_path)
    assert "trained 20 steps as Engine (ZeRO 3); logged losses [" in stdout
    losses = json.loads(stdout.split("logged losses ")[1].split("];")[0] + "]")
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-10",
                                                                                            "checkpoint-20"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lightning_example_trains_at_zero_3_with_lightnings_checkpoints(tmp_path):
    pytest.importorskip("lightning")
    stdout = launch("lightning_strategy.py", tmp_path)
    assert "trained 20 steps as Engine (ZeRO 3); last loss " in stdout
    assert (tmp_path / "epoch=0-step=20.ckpt" / "checkpoint").is_dir()
