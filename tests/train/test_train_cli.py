"""`zerodist train` end to end (subprocesses, as a user runs it) and its config precedence."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodist.train import Overrides, default_config, merge_config
from zerodist.train.report import expected_bus_bytes, state_formula, state_formula_bytes
from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]


def run_train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return run_group([sys.executable, "-m", "zerodist", "train", *args], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=timeout)


def read_losses(out: Path) -> list[float]:
    with open(out / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "lr", "tokens_per_s", "rss_mib", "tflops", "mfu", "forward_ms", "backward_ms",
                            "step_ms"]
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1))
    return [float(r["loss"]) for r in rows]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_train_and_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_train("--steps", "30", "--model", "tiny", "--nproc", "2", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"summary: 30 steps on 2 rank\(s\), ZeRO stage 2, fp32", result.stdout)
    assert summary, result.stdout[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", result.stdout).groups())
    losses = read_losses(out)
    assert len(losses) == 30
    assert (first, last) == (pytest.approx(losses[0], abs=1e-3), pytest.approx(losses[-1], abs=1e-3))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # ~5.5 = ln 256 falls well below
    assert result.stdout.count("(matches)") == 2  # both ranks' model state equals 4Ψ + 12Ψ/N
    assert "reduce_scatter" in result.stdout and "all_gather" in result.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["zero_optimization"]["stage"] == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_rank_in_process_stage_1(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_train("--steps", "8", "--model", "tiny", "--nproc", "1", "--stage", "1", "--lr", "1e-3",
                       "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "summary: 8 steps on 1 rank(s), ZeRO stage 1, fp32" in result.stdout
    assert "8Ψ + 8Ψ/N" in result.stdout and "(matches)" in result.stdout
    assert len(read_losses(out)) == 8
    config = json.loads((out / "config.json").read_text())
    assert config["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.multiprocess
def test_one_rank_stage_3_with_every_parameter_sharded(tmp_path: Path) -> None:
    # The summary must not read a full buffer from the first flat group: here it is sharded.
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    result = run_train("--steps", "3", "--model", "tiny", "--nproc", "1", "--stage", "3", "--config", str(config),
                       "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "summary: 3 steps on 1 rank(s), ZeRO stage 3, fp32" in result.stdout
    assert "16Ψ/N" in result.stdout and "(matches)" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ('{"zero_optimization": {"stag": 2}}', "stage"),
    ('{"optimizer": {"type": "Adamm", "params": {}}}', "Adam"),
])
def test_bad_config_is_one_clear_error(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(content)
    result = run_train("--config", str(path), "--steps", "2", "--model", "tiny", "--out", str(tmp_path / "run"),
                       timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.stderr.startswith("zerodist train: invalid zerodist config"), result.stderr
    assert str(path) in result.stderr and expected in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.multiprocess
def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    result = run_train("--model", "huge", "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown --model 'huge'" in result.stderr and "tiny" in result.stderr


@pytest.mark.unit
def test_file_sections_replace_defaults_and_flags_override_the_file() -> None:
    file_config = {"train_batch_size": 32, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}, "zero_optimization": {"stage": 1}}
    merged = merge_config(file_config, Overrides(lr=0.5), steps=50)
    assert merged["optimizer"] == {"type": "SGD", "params": {"lr": 0.5}}  # no AdamW betas leak in
    assert merged["scheduler"]["params"]["warmup_max_lr"] == 0.5
    assert merged["train_batch_size"] == 32 and "train_micro_batch_size_per_gpu" not in merged
    assert merged["zero_optimization"] == {"stage": 1} and merged["gradient_clipping"] == 1.0

    flagged = merge_config(file_config, Overrides(stage=0, micro_batch=4, bf16=True), steps=50)
    assert flagged["zero_optimization"]["stage"] == 0
    assert flagged["train_micro_batch_size_per_gpu"] == 4 and "train_batch_size" not in flagged
    assert flagged["bf16"] == {"enabled": True} and flagged["fp16"] == {"enabled": False}
    assert file_config["zero_optimization"] == {"stage": 1}  # the caller's dict is not modified

    plain = merge_config(None, Overrides(steps=77), steps=77)
    assert plain == default_config(77) and plain["scheduler"]["params"]["total_num_steps"] == 77


@pytest.mark.unit
def test_formulas_from_design() -> None:
    psi, n = 1024, 4
    assert [state_formula_bytes(s, False, psi, n) for s in range(4)] == [16 * psi, 8 * psi + 2 * psi,
                                                                        4 * psi + 3 * psi, 4 * psi]
    assert [state_formula_bytes(s, True, psi, n) for s in range(4)] == [16 * psi, 4 * psi + 3 * psi,
                                                                       2 * psi + 14 * psi // 4, 4 * psi]
    assert state_formula(2, True) == "2Ψ + 14Ψ/N" and state_formula(3, False) == "16Ψ/N"
    # Reduce-scatter then gather: 2Ψ(N-1)/N; stage 2 reduces every micro-step; all-reduce costs 2.
    common = dict(psi=psi, world_size=n, element_bytes=4)
    assert expected_bus_bytes(stage=1, accumulation_steps=3, reduce_scatter=True, **common) == 2 * 768 * 4
    assert expected_bus_bytes(stage=2, accumulation_steps=3, reduce_scatter=True, **common) == 4 * 768 * 4
    assert expected_bus_bytes(stage=0, accumulation_steps=1, reduce_scatter=False, **common) == 2 * 768 * 4
    assert expected_bus_bytes(stage=2, accumulation_steps=1, reduce_scatter=True, psi=psi, world_size=1,
                              element_bytes=4) == 0
