"""Helpers for tests that run `zerodist train` on the harness's pooled ranks and compare what it
writes (metrics.csv, checkpoints) with the plain demo in one process."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_cli


def run_train(*args: str, timeout: float = 300) -> Any:
    """`zerodist train ARGS` as each of its ranks runs it (`--nproc N`: N pooled ranks): what the ranks
    compute and write is the caller's subject; the launch itself is tests/train/test_train_cli.py's."""
    return run_cli(int(args[args.index("--nproc") + 1]), "train", *args, timeout=timeout)


def metrics_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def assert_losses_are_the_plain_demos(rows: list[dict[str, str]], tmp_path: Path) -> None:
    """`rows` (4 steps of the tiny model at micro-batch 2 and a global batch of 8) against the plain demo
    in one process on the same global batch (micro 2 x accumulation 4) and data order."""
    (tmp_path / "gas4.json").write_text('{"gradient_accumulation_steps": 4}')
    plain = run_train("--nproc", "1", "--config", str(tmp_path / "gas4.json"), "--model", "tiny", "--steps", "4",
                      "--micro-batch", "2", "--out", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert [float(r["loss"]) for r in rows] == pytest.approx(
        [float(r["loss"]) for r in metrics_rows(tmp_path / "plain")], abs=2e-6)


def resume_from_step_2(tmp_path: Path, common: tuple[str, ...], timeout: float = 240) -> Any:
    """`zerodist train COMMON --resume` in tmp_path/resumed from tmp_path/whole's global_step2 checkpoint
    (its metrics.csv copied, so the rows after step 2 are dropped and written again)."""
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "global_step2",
                    tmp_path / "resumed" / "checkpoints" / "global_step2")
    shutil.copy(tmp_path / "whole" / "metrics.csv", tmp_path / "resumed" / "metrics.csv")
    resumed = run_train(*common, "--resume", "--out", str(tmp_path / "resumed"), timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "global_step2" in resumed.stderr
    return resumed
