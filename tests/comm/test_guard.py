"""The collective desync guard: desyncs become named errors on every rank, within seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import zerodist.comm as comm
from zerodist.comm import collectives, guard
from tests.harness import distributed_test

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- pure parts

@pytest.mark.unit
def test_fingerprint_round_trip_and_agreement():
    a = guard.Fingerprint(3, "all_reduce", "float32", (4, 2), "train.py:10 step")
    assert guard.Fingerprint.decode(a.encode()) == a
    moved = guard.Fingerprint(3, "all_reduce", "float32", (4, 2), "train.py:99 other")
    assert a.agreement_key() == moved.agreement_key()  # call sites may differ
    uneven = [guard.Fingerprint(0, "all_to_all", "float32", (n, 8), "x") for n in (3, 5)]
    assert uneven[0].agreement_key() == uneven[1].agreement_key()  # uneven splits are legal
    assert a.describe() == "#3 all_reduce float32 shape (4, 2) at train.py:10 step"


@pytest.mark.unit
def test_env_parsing():
    assert guard.guard_requested({}) is False
    assert guard.guard_requested({"ZERODIST_COLLECTIVE_GUARD": "1"}) is True
    assert guard.guard_requested({"ZERODIST_COLLECTIVE_GUARD": "off"}) is False
    with pytest.raises(ValueError, match="ZERODIST_COLLECTIVE_GUARD='maybe'"):
        guard.guard_requested({"ZERODIST_COLLECTIVE_GUARD": "maybe"})
    with pytest.raises(ValueError, match="> 0"):
        guard.resolve_guard_timeout(0)
    assert guard.format_ranks([0, 1, 2, 5]) == "0-2, 5"


@pytest.mark.unit
def test_guard_off_costs_nothing_and_enable_disable_round_trips():
    assert collectives.pre_collective_hooks == []
    with comm.collective_guard(timeout_s=2) as active:
        assert collectives.pre_collective_hooks == [active]
        with comm.collective_guard(timeout_s=7):
            assert active.timeout_s == 7
        assert active.timeout_s == 2 and collectives.pre_collective_hooks == [active]
    assert collectives.pre_collective_hooks == []
    comm.disable_collective_guard()  # twice is fine


@pytest.mark.multiprocess
def test_env_var_turns_the_guard_on_for_any_program():
    code = ("import torch, zerodist.comm as c; from zerodist.comm import collectives as k; "
            "t = torch.ones(2); c.all_reduce(t); print(len(k.pre_collective_hooks), t.tolist())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(ZERODIST_COLLECTIVE_GUARD="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1 [1.0, 1.0]"


# ---------------------------------------------------------------- on real ranks

@distributed_test(world_size=[1, 2, 4])
def test_matching_collectives_pass_and_keys_are_cleaned(world_size):
    rank, n = comm.get_rank(), world_size
    assert collectives.pre_collective_hooks == []  # off by default in every worker
    active = comm.enable_collective_guard(timeout_s=5)
    try:
        for _ in range(3):
            t = torch.full((4,), float(rank + 1))
            comm.all_reduce(t)
            assert t.tolist() == [n * (n + 1) / 2] * 4
        out = torch.empty(2 * n)
        comm.all_gather(out, torch.full((2,), float(rank)))
        # uneven all_to_all: rank r sends r+1 elements to each rank; outputs differ in size
        received = torch.empty(sum(r + 1 for r in range(n)))
        comm.all_to_all_single(received, torch.full(((rank + 1) * n,), float(rank)),
                               output_split_sizes=[r + 1 for r in range(n)], input_split_sizes=[rank + 1] * n)
        objects = [None] * n
        comm.all_gather_object(objects, rank)
        assert objects == list(range(n))
        if n > 1:
            topo = comm.Topology(tensor=2 if n == 4 else 1)
            comm.all_reduce(torch.ones(3), group=topo.group("tensor"))
        comm.barrier()
        if n > 1:
            state = active.group_state()
            store = active._store
            last = state.seq - 1
            assert store.check([active.key(state, last, r) for r in range(n)])
            assert not any(store.check([active.key(state, s, r)]) for s in range(last) for r in range(n))
    finally:
        comm.disable_collective_guard()
    assert collectives.pre_collective_hooks == []


def _expect_mismatch(action) -> str:
    # Named by the guard's check, not at the collective timeout: that would be a CollectiveTimeoutError,
    # which is no CollectiveMismatchError (no clock needed to tell them apart).
    with pytest.raises(comm.CollectiveMismatchError) as info:
        action()
    return str(info.value)


@distributed_test(world_size=[2, 4])
def test_shape_mismatch_fails_on_every_rank_naming_rank_shapes_and_call_site(world_size):
    rank = comm.get_rank()
    comm.enable_collective_guard(timeout_s=5)
    try:
        comm.all_reduce(torch.ones(4))
        wrong = torch.ones(5 if rank == 1 else 4)
        message = _expect_mismatch(lambda: comm.all_reduce(wrong))  # the line every rank names
    finally:
        comm.disable_collective_guard()
    assert "collective #1" in message
    assert "shape (4,)" in message and "shape (5,)" in message
    assert re.search(r"rank 1: #1 all_reduce float32 shape \(5,\) at tests/comm/test_guard\.py:\d+", message)
    assert "<lambda>" in message
    if world_size == 4:
        assert "diverging rank(s): 1 (ranks 0, 2-3 agree)" in message
    else:
        assert "no majority" in message


@distributed_test(world_size=[2, 4])
def test_a_rank_that_skips_a_collective_fails_everywhere(world_size):
    rank = comm.get_rank()
    comm.enable_collective_guard(timeout_s=5)
    try:
        def step():
            if rank != 1:  # rank 1 "forgets" this all_reduce and goes on to the all_gather
                comm.all_reduce(torch.ones(4))
            comm.all_gather(torch.empty(2 * world_size), torch.ones(2))

        message = _expect_mismatch(step)
    finally:
        comm.disable_collective_guard()
    assert "rank 1: #0 all_gather" in message and "all_reduce float32 shape (4,)" in message
    assert "diverging rank(s)" in message


def _until_rank_gave_up(peer: int) -> None:
    """Until `peer` has given up waiting in this group's next checked collective (as it tells the store)."""
    active = guard.active_guard()
    state = active.group_state()
    key = active.key(state, state.seq, peer)
    deadline = time.monotonic() + 60
    while not (active._store.check([key]) and guard.Fingerprint.decode(active._store.get(key)).aborted):
        assert time.monotonic() < deadline, f"rank {peer} did not give up within 60 s"
        time.sleep(0.05)


@distributed_test(world_size=2)
def test_a_rank_that_never_arrives_fails_both_ranks():
    rank = comm.get_rank()
    comm.enable_collective_guard(timeout_s=0.5)
    try:
        comm.all_reduce(torch.ones(1))
        if rank == 1:
            # late past the bound: it must not join a collective alone. It comes once rank 0 has given
            # up (a sleep of 1.5 s raced rank 0's 0.5 s on a loaded machine by 1 s of margin).
            _until_rank_gave_up(0)
            message = _expect_mismatch(lambda: comm.all_reduce(torch.ones(1)))
            assert "arrived after the others gave up" in message and "rank 0 gave up waiting" in message
        else:
            message = _expect_mismatch(lambda: comm.all_reduce(torch.ones(1)))
            assert "rank(s) 1 of group" in message and "within 0.5 s" in message
            assert "rank 1: last checked collective #0 all_reduce" in message
    finally:
        comm.disable_collective_guard()
