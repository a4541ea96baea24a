"""`zerodist train --moe N`: the MoE demo on the harness's pooled ranks, as each launched rank runs it
(harness.run_cli; the launch is tests/train/test_train_cli.py's), and its named error before any
rank starts (a subprocess, as a user runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import run_cli
from tests.train.test_train_cli import read_losses, run_train

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
def test_moe_demo_trains_and_reports_the_load_per_layer(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(2, "train", "--moe", "4", "--steps", "12", "--model", "tiny", "--nproc", "2", "--out", str(out),
                     timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    layers = re.findall(r"MoE layer (\d): ((?:\s+[\d.]+%){4})\s+imbalance ([\d.]+), dropped ([\d.]+)%", result.stdout)
    assert [layer for layer, *_ in layers] == ["0", "1"], result.stdout[-3000:]
    for _, shares, imbalance, _ in layers:
        assert abs(sum(float(s.rstrip("%")) for s in shares.split()) - 100) < 0.5
        assert float(imbalance) >= 1.0
    measured, formula = re.search(r"all-to-all per step on this rank: (.+) measured, (.+) by 4 x E", result.stdout).groups()
    assert measured == formula
    assert result.stdout.count("(matches)") == 2  # model state per domain: dense over 2 ranks, experts over 1
    losses = read_losses(out)
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert (out / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_expert_count_must_divide_over_the_ranks(tmp_path: Path) -> None:
    result = run_train("--moe", "3", "--nproc", "2", "--model", "tiny", "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert "--moe 3: the experts are spread over the 2 expert-parallel rank(s)" in result.stderr
