"""`zerodist train --save-interval N` and `--resume`: the demo saves and continues exactly."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.test_train_cli import REPO, run_train
from zerodist.checkpoint import consolidate_checkpoint

pytestmark = pytest.mark.multiprocess


def _last_row(out: Path) -> dict[str, str]:
    with open(out / "metrics.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))[-1]


@pytest.mark.slow
def test_train_saves_every_n_steps_and_resumes_exactly(tmp_path: Path) -> None:
    common = ("--steps", "8", "--model", "tiny", "--nproc", "1", "--save-interval", "4")
    whole = run_train(*common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["global_step4", "global_step8",
                                                                                       "latest"]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "global_step4", tmp_path / "resumed" / "checkpoints" /
                    "global_step4")
    resumed = run_train(*common, "--resume", "--out", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "loaded checkpoint" in resumed.stderr and "global_step4" in resumed.stderr
    assert _last_row(tmp_path / "resumed")["step"] == "8"
    assert _last_row(tmp_path / "resumed")["loss"] == _last_row(tmp_path / "whole")["loss"]
    final = [consolidate_checkpoint(tmp_path / run / "checkpoints", "global_step8") for run in ("whole", "resumed")]
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), key


def test_train_help_names_the_checkpoint_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "zerodist", "train", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert "--save-interval N" in done.stdout and "--resume" in done.stdout
