"""`zerodist train --sp P --seq-len N`: the sequence-parallel demo on the harness's pooled ranks, as
each launched rank runs it (harness.run_cli; the launch is tests/train/test_train_cli.py's), and its
named errors before any rank starts (subprocesses, as a user runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import run_cli
from tests.train.test_train_cli import read_losses, run_train

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
def test_sequence_demo_reports_all_to_all_bytes_against_the_formula(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(2, "train", "--sp", "2", "--nproc", "2", "--seq-len", "64", "--model", "tiny", "--steps", "4",
                     "--out", str(out), timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sequence parallel (ulysses, degree 2):" in result.stdout
    line = re.search(r"all-to-all per micro-step on rank 0: (.+) sent \(tracer\); formula .* = (.+) \((\w+)\)",
                     result.stdout)
    assert line is not None and line.group(1) == line.group(2) and line.group(3) == "matches", result.stdout[-3000:]
    assert re.search(r"activation memory per rank .*: rank 0 [\d.]+ \w+, rank 1 [\d.]+ \w+", result.stdout)
    assert result.stdout.count("(matches)") == 3  # model state on each rank, and the all-to-all
    assert len(read_losses(out)) == 4


def test_sequence_errors_come_before_any_rank_starts(tmp_path: Path) -> None:
    heads = run_train("--sp", "4", "--nproc", "4", "--model", "tiny", "--out", str(tmp_path / "a"), timeout=60)
    assert heads.returncode == 2
    assert "2 heads are not divisible by sequence_parallel_size=4" in heads.stderr and "ring" in heads.stderr
    length = run_train("--sp", "2", "--nproc", "2", "--seq-len", "33", "--model", "tiny", "--out", str(tmp_path / "b"),
                       timeout=60)
    assert length.returncode == 2
    assert "sequence length 33 is not divisible by 2 sequence-parallel ranks" in length.stderr
