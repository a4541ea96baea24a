"""reduce_loss against hand-computed references, and the straggler report with an injected delay."""

from __future__ import annotations

import time

import pytest
import torch

import zerodist.comm as comm
from zerodist.debug import StepTimer, reduce_loss, straggler_report
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess


def rank_loss(rank: int) -> float:
    return 0.25 + 1.5 * rank


def rank_tokens(rank: int) -> int:
    return [7, 1, 0, 30][rank]  # uneven, one rank with no tokens at all


@distributed_test(world_size=[1, 2, 4])
def test_reduce_loss_matches_hand_computed_means(world_size):
    rank, n = comm.get_rank(), world_size
    loss = torch.tensor(rank_loss(rank), requires_grad=True) * 1.0  # a non-leaf, as after forward

    mean = reduce_loss(loss)
    assert not mean.requires_grad and mean.dtype == torch.float32 and mean.shape == ()
    assert mean.item() == pytest.approx(sum(rank_loss(r) for r in range(n)) / n)

    weighted = reduce_loss(loss, num_tokens=rank_tokens(rank))
    total_tokens = sum(rank_tokens(r) for r in range(n))
    expected = sum(rank_loss(r) * rank_tokens(r) for r in range(n)) / total_tokens
    assert weighted.item() == pytest.approx(expected)
    # a tensor count works too, and a plain mean of means would be wrong here
    assert reduce_loss(loss, num_tokens=torch.tensor(rank_tokens(rank))).item() == pytest.approx(expected)
    if n == 4:
        assert expected != pytest.approx(sum(rank_loss(r) for r in range(n)) / n)

    low = reduce_loss(torch.tensor(rank_loss(rank), dtype=torch.bfloat16))
    assert low.dtype == torch.float32


@distributed_test(world_size=[1, 2])
def test_reduce_loss_reports_bad_input_on_every_rank(world_size):
    rank = comm.get_rank()
    loss = torch.tensor(1.0) if rank == 0 else torch.ones(3)  # a world of 1 only has the good loss
    if world_size == 1:
        with pytest.raises(ValueError, match="must be a scalar"):
            reduce_loss(torch.ones(3))
        return
    with pytest.raises(ValueError, match="1 of 2 rank"):
        reduce_loss(loss)
    with pytest.raises(ValueError, match="1 of 2 rank.*passed num_tokens and the others did not"):
        reduce_loss(torch.tensor(1.0), num_tokens=5 if rank == 0 else None)
    with pytest.raises(ValueError, match="sum to 0"):
        reduce_loss(torch.tensor(1.0), num_tokens=0)
    # rank 0 learns that rank 1 was wrong; rank 1 learns why
    mine = r"rank 0\): ok" if rank == 0 else r"rank 1\): num_tokens must be >= 0, got -1"
    with pytest.raises(ValueError, match="1 of 2 rank.*" + mine):
        reduce_loss(torch.tensor(1.0), num_tokens=-1 if rank == 1 else 3)


# ---------------------------------------------------------------- straggler report

@distributed_test(world_size=[2, 4])
def test_straggler_report_names_the_delayed_rank(world_size):
    rank = comm.get_rank()
    slow = world_size - 1
    timer = StepTimer(warmup_steps=1)
    for _ in range(4):
        with timer.step():
            time.sleep(0.02 + (0.2 if rank == slow else 0.0))  # the rank's own work
        comm.barrier()  # the sync point where everyone waits for the slow rank
    report = timer.report()
    assert [r.rank for r in report.ranks] == list(range(world_size))
    assert all(r.num_steps == 3 for r in report.ranks)
    assert report.slowest_rank == slow and report.spread > 3
    # A 1.5x threshold: on a loaded machine the fast ranks' 20 ms sleeps vary by more than the default 10%.
    assert report.stragglers(threshold=1.5) == [slow]
    assert report.ranks[slow].median_s >= 0.22
    assert "<- slowest" in report.format().splitlines()[slow + 1]


@distributed_test(world_size=2)
def test_straggler_report_from_plain_lists():
    times = [0.1, 0.3, 0.2] if comm.get_rank() == 0 else [0.1, 0.1]
    report = straggler_report(times)
    r0, r1 = report.ranks
    assert (r0.num_steps, r0.mean_s, r0.median_s, r0.max_s) == (3, pytest.approx(0.2), 0.2, 0.3)
    assert (report.slowest_rank, report.fastest_rank, report.spread) == (0, 1, pytest.approx(2.0))
