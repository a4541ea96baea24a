"""`zerodist train --pp 2` on 4 ranks: the plain demo's loop over the GPT cut by `split_model`, so the
same metrics.csv, summary.txt, loss.png, checkpoints and `--resume`; the summary shows the bubble
measured beside the simulator's and the formula's, and the p2p and tensor-parallel bytes against
their formulas. `--pp 2 --tp 2`: the losses are the plain demo's in one process on the same global
batch, and a `--resume` from the step-2 checkpoint of a `--save-interval 2` run repeats the
uninterrupted run's losses and parameters."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.train_cli import assert_losses_are_the_plain_demos, metrics_rows, resume_from_step_2, run_train
from zerodist.checkpoint import consolidate_checkpoint


def _train_cli_in_place(out: str, schedule: str):
    import zerodist.comm as comm
    from zerodist.cli.train import build_plan
    from zerodist.cli.train import train_in_place as train  # runs and prints what rank 0 reports

    args = argparse.Namespace(model="tiny", steps=3, config=None, out=out, stage=None, micro_batch=2, lr=None,
                              bf16=False, fp16=False, seed=None, save_interval=None, resume=False, tp=None, domino=None,
                              moe=None, pp=2, schedule=schedule)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train(build_plan(args, comm.get_world_size()))
    return code, printed.getvalue()


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_zerodist_train_pp_2_on_4_ranks(tmp_path, schedule):
    results = run_distributed(_train_cli_in_place, 4, str(tmp_path), schedule, timeout=120)
    assert [code for code, _ in results] == [0, 0, 0, 0]
    text = results[0][1]
    assert "2 stages on 2 pipe ranks x 2 data" in text
    assert "schedule simulator 0.200" in text and "(p-1)/(v m+p-1) = 0.200" in text
    assert "= 1.00 x the formula 2 m x" in text
    assert "bubble: " in text and " measured (executor's timed actions" in text
    assert _rows(tmp_path) and [r["step"] for r in _rows(tmp_path)] == ["1", "2", "3"]


_rows = metrics_rows


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_tp2_trains_saves_and_resumes_like_the_plain_demo(tmp_path: Path) -> None:
    common = ("--pp", "2", "--tp", "2", "--nproc", "4", "--model", "tiny", "--steps", "4", "--micro-batch", "2",
              "--save-interval", "2")
    whole = run_train(*common, "--out", str(tmp_path / "whole"), timeout=240)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and all(float(r["loss"]) > 0 for r in rows)
    assert rows[0]["forward_ms"] and rows[0]["backward_ms"]  # the executor's timed actions
    summary = (tmp_path / "whole" / "summary.txt").read_text()
    assert "4 steps on 4 ranks (pipe 2 x data 1 x tensor 2" in summary
    assert "matches" in summary and "differs" not in summary  # each rank's state against its stages' formula
    assert "schedule simulator 0.200" in summary and " measured (executor's timed actions" in summary
    assert "= 1.00 x the formula 2 m x" in summary  # p2p bytes
    assert "forward 24.00 KiB (formula 24.00 KiB: matches), backward 16.00 KiB (formula 16.00 KiB: matches)" in summary
    assert (tmp_path / "whole" / "loss.png").is_file() or "loss curve not written" in whole.stdout
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["global_step2", "global_step4",
                                                                                       "latest"]

    assert_losses_are_the_plain_demos(rows, tmp_path)
    resumed = resume_from_step_2(tmp_path, common)
    assert "loaded checkpoint" in resumed.stderr
    again = _rows(tmp_path / "resumed")
    assert [r["step"] for r in again] == ["1", "2", "3", "4"]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]  # the written losses, to 6 decimals
    final = [consolidate_checkpoint(tmp_path / run / "checkpoints", "global_step4") for run in ("whole", "resumed")]
    assert set(final[0]) == set(final[1])
    for key in final[0]:
        assert torch.allclose(final[0][key], final[1][key], rtol=0, atol=1e-6), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_moe2_reports_the_stage_s_all_to_all_against_its_formula(tmp_path: Path) -> None:
    done = run_train("--pp", "2", "--moe", "2", "--nproc", "4", "--model", "tiny", "--steps", "2", "--micro-batch", "2",
                     "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pipeline: 2 stages on 2 pipe ranks x 1 data x 2 expert" in done.stdout
    measured = re.search(r"all-to-all per step on this rank: (\S+ \S+) measured, (\S+ \S+) by", done.stdout)
    assert measured is not None and measured.group(1) == measured.group(2), done.stdout[-3000:]
    assert "matches" in done.stdout and "differs" not in done.stdout
    assert [r["step"] for r in _rows(tmp_path)] == ["1", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_sp2_trains_like_the_plain_demo_and_reports_ulysses_bytes(tmp_path: Path) -> None:
    """`--pp 2 --sp 2`: each stage's attention runs Ulysses over its sequence pair, the stages pass each
    rank's sequence slice; the losses are the plain demo's in one process on the same global batch."""
    done = run_train("--pp", "2", "--sp", "2", "--nproc", "4", "--model", "tiny", "--steps", "3", "--micro-batch", "2",
                     "--out", str(tmp_path / "pipe"), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "pipe" / "summary.txt").read_text()
    assert "3 steps on 4 ranks (pipe 2 x data 1 x sequence 2 x tensor 1" in summary
    assert "sequence parallel (ulysses, degree 2)" in summary
    assert "= 1.00 x the formula 2 m x" in summary  # p2p bytes: the local sequence length
    assert "matches" in summary and "differs" not in summary  # Ulysses bytes, each rank's state
    (tmp_path / "gas4.json").write_text('{"gradient_accumulation_steps": 4}')
    plain = run_train("--nproc", "1", "--config", str(tmp_path / "gas4.json"), "--model", "tiny", "--steps", "3",
                      "--micro-batch", "2", "--out", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert [float(r["loss"]) for r in _rows(tmp_path / "pipe")] == pytest.approx(
        [float(r["loss"]) for r in _rows(tmp_path / "plain")], abs=2e-6)


def test_pp_that_does_not_divide_the_ranks_is_refused():
    from zerodist.cli.train import build_plan

    args = argparse.Namespace(model="tiny", steps=3, config=None, out="/tmp/x", stage=None, micro_batch=2, lr=None,
                              bf16=False, fp16=False, seed=None, save_interval=None, resume=False, tp=None,
                              domino=None, moe=None, pp=3, schedule=None)
    with pytest.raises(ValueError, match="not divisible by the pipeline degree 3"):
        build_plan(args, 4)


test_pp_that_does_not_divide_the_ranks_is_refused = pytest.mark.unit(test_pp_that_does_not_divide_the_ranks_is_refused)
