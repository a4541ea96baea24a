"""The backend is chosen for the node ([Note: one backend per world] in zerodist/comm/init.py): NCCL only
where every local rank has its own GPU, so ranks never split between NCCL and gloo."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from zerodist.comm import init as comm_init

pytestmark = pytest.mark.unit


@pytest.fixture
def gpus(monkeypatch):
    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(comm_init, "_warned_cpu_fallback", set())
    monkeypatch.delenv("ZERODIST_BACKEND", raising=False)
    return set_count


@pytest.mark.parametrize("count, local_world, expected", [(0, 1, "gloo"), (1, 1, "nccl"), (2, 2, "nccl"),
                                                          (8, 4, "nccl"), (1, 2, "gloo"), (4, 8, "gloo")])
def test_every_local_rank_takes_the_same_backend(gpus, monkeypatch, count, local_world, expected):
    gpus(count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert {comm_init.choose_backend(rank, None) for rank in range(local_world)} == {expected}


def test_more_ranks_than_gpus_warns_once_and_says_how_to_get_nccl(gpus, monkeypatch, caplog):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING):
        for rank in (0, 1, 0):
            assert comm_init.choose_backend(rank, None) == "gloo"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "2 rank(s) on this node but 1 GPU(s)" in warnings[0] and "--nproc-per-node 1" in warnings[0]


def test_an_explicit_choice_wins_and_nccl_without_a_gpu_per_rank_is_refused(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ZERODIST_BACKEND", "gloo")
    assert comm_init.choose_backend(0, None) == "gloo"
    monkeypatch.setattr(dist, "is_backend_available", lambda name: True)
    with pytest.raises(comm_init.DistributedInitError, match="local rank 1 sees 1 GPU"):
        comm_init.choose_backend(1, "nccl")
