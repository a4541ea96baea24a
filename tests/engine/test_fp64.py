"""An all-fp64 model trains in fp64 through plain `initialize()` (no bf16/fp16 section), as it does
under DeepSpeed: the parameters stay fp64 and equal one fp64 process within 1e-12 at ZeRO 0-3.
Before, the engine cast it to fp32 (and warned), which costs ~1e-8 of parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config, global_batch
from tests.harness import run_distributed
from zerodist.models import make_mlp
from zerodist.precision import PrecisionPolicy

STEPS, MICRO = 3, 4
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def fp64_body(stage: int) -> tuple[str, dict[str, torch.Tensor]]:
    engine, _, _, _ = zerodist.initialize(model=make_mlp().double(), config=base_config(stage, optimizer=SGD))
    n, rank = comm.get_world_size(), comm.get_rank()
    for step in range(STEPS):
        x, y = (t.double() for t in global_batch(step, MICRO * n))
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    name = engine.policy.name
    engine.destroy()
    return name, state


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp64_model_trains_in_fp64(stage):
    model = make_mlp().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = (t.double() for t in global_batch(step, MICRO * 2))
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    for name, state in run_distributed(fp64_body, 2, stage):
        assert name == "fp64"
        for key, expected in model.state_dict().items():
            assert state[key].dtype == torch.float64, key
            assert torch.allclose(state[key], expected, rtol=0, atol=1e-12), key


@pytest.mark.unit
def test_policy_for_model_picks_fp64_only_for_an_all_fp64_model():
    fp32 = PrecisionPolicy()
    assert fp32.for_model(make_mlp().double()).param_dtype == torch.float64
    assert fp32.for_model(make_mlp()) is fp32
    mixed = make_mlp()
    mixed[0].double()
    assert fp32.for_model(mixed) is fp32  # a mix keeps fp32 (and its recast warning)
    bf16 = PrecisionPolicy(torch.bfloat16)
    assert bf16.for_model(make_mlp().double()) is bf16  # the config's mixed precision wins
    assert not PrecisionPolicy(torch.float64).needs_master_copy
