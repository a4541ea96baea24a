"""A reported error ends every rank with a plain exit status: no rank killed by torchrun's SIGTERM
for leaving a moment later, none aborted in gloo's teardown ([Note: leaving together])."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerodist.cli.run import describe_failures
from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_config_error_every_rank_finds_ends_both_ranks_with_status_2(tmp_path: Path) -> None:
    # Valid for the launcher's checks; only the ranks' initialize() builds the schedule and finds it wrong.
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR",
                                                "params": {"total_num_steps": 5, "warmup_num_steps": 10}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    out = run_group([sys.executable, "-m", "zerodist", "train", "--nproc", "2", "--model", "tiny", "--steps", "5",
                     "--config", str(config), "--out", str(tmp_path / "run")], cwd=REPO, env=env, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert text.count("zerodist train: invalid zerodist config: WarmupDecayLR: total_num_steps (5) < "
                      "warmup_num_steps (10)") == 1, text[-3000:]  # said once, by rank 0
    assert "zerodist: rank 0 exited with status 2; rank 1 exited with status 2" in out.stderr, text[-3000:]
    # torchrun may still log that it sent SIGTERM to the rank that left a moment later: that rank
    # ignores it from the moment it leaves, so its status above is its own.
    assert "Traceback" not in text and "terminate called" not in text and "killed by" not in text, text[-3000:]


@pytest.mark.unit
def test_failures_are_described_per_rank_in_rank_order() -> None:
    def failure(code: int) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code, signal_name=lambda: {-15: "SIGTERM", -6: "SIGABRT"}[code])

    assert describe_failures({1: failure(-15), 0: failure(2)}) == (
        "rank 0 exited with status 2; rank 1 was killed by SIGTERM (-15)")
    assert describe_failures({0: failure(-6)}) == "rank 0 was killed by SIGABRT (-6)"
