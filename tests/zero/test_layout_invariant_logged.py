"""The layout-invariant mode's logged loss (issue 35, docs/determinism.md): what the monitors write
(and steps_per_print logs) is the canonical average train_batch() returns, with and without a pipeline."""

from __future__ import annotations

import csv
import glob
import os

import pytest
import torch

from tests.harness import run_distributed
from tests.zero.layout_invariant_helpers import train_in_mode
from tests.zero.test_layout_invariant_pipe import pipelined


def _logged(folder: str) -> list[float]:
    (path,) = [p for p in glob.glob(os.path.join(folder, "**", "*.csv"), recursive=True) if "loss" in p]
    with open(path) as handle:
        return [float(row[1]) for row in list(csv.reader(handle))[1:]]


def _monitor(folder: str) -> dict:
    return {"enabled": True, "output_path": folder, "job_name": "layout"}


@pytest.mark.slow
def test_the_monitors_write_the_canonical_average(tmp_path):
    plain, piped = str(tmp_path / "plain"), str(tmp_path / "pipe")
    (result, _) = run_distributed(train_in_mode, 2, 1, 3, timeout=240, csv_monitor=_monitor(plain))
    assert _logged(plain) == result["losses"].tolist()
    results = run_distributed(pipelined, 2, 1, "1f1b", 2, 0, 3, timeout=240, csv_monitor=_monitor(piped))
    assert _logged(piped) == results[0]["losses"].tolist()
    assert torch.equal(results[0]["losses"], results[1]["losses"])
