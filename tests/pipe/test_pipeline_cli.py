"""`zerodist train --pp 2` on 4 ranks: the summary shows the bubble against the formula and the
p2p bytes against 2 m x activation bytes per boundary."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from tests.harness import run_distributed


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
    assert "2 pipeline stages on 2 pipe ranks x 2 data" in text
    assert "bubble: 0.200 of each rank's time" in text and "= 0.200" in text
    assert "= 1.00 x 2 m x" in text


def test_pp_that_does_not_divide_the_ranks_is_refused():
    from zerodist.cli.train import build_plan

    args = argparse.Namespace(model="tiny", steps=3, config=None, out="/tmp/x", stage=None, micro_batch=2, lr=None,
                              bf16=False, fp16=False, seed=None, save_interval=None, resume=False, tp=None,
                              domino=None, moe=None, pp=3, schedule=None)
    with pytest.raises(ValueError, match="not divisible by the pipeline degree 3"):
        build_plan(args, 4)


test_pp_that_does_not_divide_the_ranks_is_refused = pytest.mark.unit(test_pp_that_does_not_divide_the_ranks_is_refused)
