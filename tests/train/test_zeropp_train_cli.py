"""`zerodist train --nnodes-sim K`: the demo as K simulated nodes, its bytes per link class against
docs/design/zero.md's formulas (on the harness's pooled ranks, as each launched rank runs it: the
launch is tests/train/test_train_cli.py's), and its named error (a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness import run_cli
from tests.train.test_train_cli import read_losses, run_train

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
# plain ZeRO-3 and the three ZeRO++ levers together; MiCS's bytes per link are checked in process
# (tests/zero/test_zeropp.py), so the demo is not run a third time for it
@pytest.mark.parametrize("keys", [{}, {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                       "zero_quantized_gradients": True}])
def test_simulated_nodes_demo_reports_bytes_per_link_against_the_formula(tmp_path: Path, keys: dict) -> None:
    config = tmp_path / "config.json"
    # every parameter sharded, so that qwZ has gathers to quantize
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **keys}}))
    out = tmp_path / "run"
    result = run_cli(4, "train", "--nproc", "4", "--nnodes-sim", "2", "--model", "tiny", "--steps", "3",
                     "--config", str(config), "--out", str(out), timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "links: 2 node(s) of 2 rank(s) (simulated)" in result.stdout
    for link in ("intra", "inter"):
        line = re.search(rf"{link}-node: .* measured, .* formula \(([\d.]+)x|{link}-node: 0 B measured, 0 B .*\(-",
                         result.stdout)
        assert line is not None, result.stdout[-3000:]
        if line.group(1) is not None:  # the step's scalar all-reduces (a few bytes) ride on top of the formula
            assert 1.0 <= float(line.group(1)) <= 1.01, line.group(0)
    if keys.get("zero_quantized_weights"):
        assert "last step's quantization error, qwZ weights" in result.stdout
        assert "last step's quantization error, qgZ gradients" in result.stdout
    assert len(read_losses(out)) == 3


def test_nnodes_sim_must_divide_nproc(tmp_path: Path) -> None:
    result = run_train("--nproc", "4", "--nnodes-sim", "3", "--model", "tiny", "--out", str(tmp_path / "a"), timeout=60)
    assert result.returncode == 2
    assert "--nnodes-sim 3 does not divide --nproc 4" in result.stderr
