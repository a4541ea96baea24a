"""The collective guard under a real engine: a correct run trains to the same result with it on."""

from __future__ import annotations

import pytest
import torch

import zerodist.comm as comm
from tests.engine_helpers import base_config, train_distributed
from tests.harness import distributed_test

STEPS = 3


@distributed_test(world_size=2, timeout=150)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_guard_on_trains_to_the_same_weights_as_guard_off(stage):
    torch.manual_seed(0)
    engine, plain = train_distributed(base_config(stage), STEPS)
    engine.destroy()
    torch.manual_seed(0)
    config = base_config(stage, zerodist={"debug": {"collective_guard": True}})
    try:
        engine, guarded = train_distributed(config, STEPS)
        active = comm.guard.active_guard()
        assert active is not None and sum(g.seq for g in active._groups.values()) > STEPS  # it really checked
        engine.destroy()
    finally:
        comm.disable_collective_guard()
    assert plain.keys() == guarded.keys()
    for name in plain:
        assert torch.equal(plain[name], guarded[name]), name
