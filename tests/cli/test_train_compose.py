"""`zerodist train` with products of the parallelism flags that the demo used to refuse (issue 31,
item 6): `--pp 2 --tp 2 --domino 2` (Domino per pipeline stage) trains like the plain demo in one
process, saves and resumes; `--moe` with `--sp` and with `--tp --domino` trains with every axis'
bytes matching their formulas; what cannot work is refused by name before any rank starts."""

from __future__ import annotations

import re
import json
from pathlib import Path

import pytest

from tests.train_cli import assert_losses_are_the_plain_demos, metrics_rows, resume_from_step_2, run_train


_rows = metrics_rows


def _no_formula_differs(text: str) -> None:
    assert "matches" in text and "differs" not in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_tp2_domino_trains_like_the_plain_demo_saves_and_resumes(tmp_path: Path) -> None:
    common = ("--pp", "2", "--tp", "2", "--domino", "2", "--nproc", "4", "--model", "tiny", "--steps", "4",
              "--micro-batch", "2", "--save-interval", "2")
    whole = run_train(*common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    summary = (tmp_path / "whole" / "summary.txt").read_text()
    assert "4 steps on 4 ranks (pipe 2 x data 1 x tensor 2" in summary
    assert "Domino 2 chunks: 100% of forward" in summary
    _no_formula_differs(summary)  # each rank's state, the p2p and the tensor-parallel bytes
    assert (tmp_path / "whole" / "loss.png").is_file() or "loss curve not written" in whole.stdout
    assert_losses_are_the_plain_demos(rows, tmp_path)
    resume_from_step_2(tmp_path, common, timeout=300)
    assert [r["loss"] for r in _rows(tmp_path / "resumed")] == [r["loss"] for r in rows]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("flags, sections", [
    (("--sp", "2"), ("sequence parallel (ulysses, degree 2)",)),
    (("--tp", "2", "--domino", "2", "--stage", "3"), ("tensor parallel (degree 2)", "Domino 2 chunks")),
])
def test_moe_with_sequence_or_tensor_and_domino_trains_with_each_axis_bytes(tmp_path: Path, flags, sections) -> None:
    done = run_train("--moe", "2", *flags, "--nproc", "4", "--model", "tiny", "--steps", "2", "--micro-batch", "2",
                     "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path)] == ["1", "2"]
    for section in sections:
        assert section in done.stdout
    measured = re.search(r"all-to-all per step on this rank: (\S+ \S+) measured, (\S+ \S+) by", done.stdout)
    assert measured is not None and measured.group(1) == measured.group(2), done.stdout[-3000:]
    _no_formula_differs(done.stdout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_tp2_sp2_domino_on_8_ranks_reports_every_axis_against_its_formula(tmp_path: Path) -> None:
    """Issue 31's `zerodist train --pp 2 --tp 2 --sp 2 --nproc 8`, with Domino: each rank's state, the
    pipe's p2p, the tensor axis' schedule-log bytes (over the slice's tokens) and Ulysses' all-to-alls
    (over the heads a tensor rank holds) each match their formula; a checkpoint is written."""
    done = run_train("--pp", "2", "--tp", "2", "--sp", "2", "--domino", "2", "--nproc", "8", "--model", "small",
                     "--seq-len", "32", "--steps", "2", "--micro-batch", "2", "--save-interval", "2",
                     "--out", str(tmp_path), timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "2 steps on 8 ranks (pipe 2 x data 1 x sequence 2 x tensor 2" in summary
    for section in ("Domino 2 chunks", "sequence parallel (ulysses, degree 2)", "= 1.00 x the formula 2 m x"):
        assert section in summary
    _no_formula_differs(summary)
    assert [r["step"] for r in _rows(tmp_path)] == ["1", "2"]
    assert (tmp_path / "checkpoints" / "global_step2").is_dir()


@pytest.mark.unit
@pytest.mark.parametrize("flags, words", [
    (("--domino", "2"), "needs a tensor-parallel degree of 2 or more"),
    (("--tp", "2", "--sp", "2", "--model", "tiny"), "each tensor rank holds 1 of the 2 heads of --model tiny"),
    (("--tp", "4", "--model", "tiny"), "splits the 2 attention heads of --model tiny"),
    (("--tp", "2", "--domino", "3", "--micro-batch", "2"), "use a --micro-batch divisible by 3"),
    (("--moe", "2", "--tp", "2", "--domino", "2", "--micro-batch", "1"), "use a --micro-batch divisible by 2"),
])
def test_impossible_products_are_refused_by_name_before_spawn(flags, words, capsys) -> None:
    from zerodist.cli.main import main

    assert main(["train", *flags, "--nproc", "4", "--out", "/tmp/unused"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.unit
def test_moe_with_inter_overlap_from_a_config_file_is_refused_before_spawn(tmp_path: Path, capsys) -> None:
    """--moe and a --config file's Domino "inter" (no --domino on the command line, which would make it
    "intra"): every rank raised DominoStreamError at its first forward; now refused, rc 2."""
    from zerodist.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2},
                                  "zerodist": {"tensor_parallel": {"domino": {"chunks": 2, "overlap": "inter"}}}}))
    assert main(["train", "--moe", "2", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "o")]) == 2
    assert 'set "overlap": "intra"' in capsys.readouterr().err
