"""fp32/bf16 have no loss scaler to notice a NaN: one rank's NaN loss used to turn every weight on
every rank into NaN, silently. Now every rank skips the step, naming the rank, or raises by config."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from tests.debug_helpers import captured_logs
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test
from zerodist.debug import NonFiniteError
from zerodist.models import make_mlp


def _train(config, batches, poison=None):
    """Train on `batches` (global batch indices); at step `poison` rank 1's loss is NaN."""
    torch.manual_seed(0)
    engine, *_ = zerodist.initialize(model=make_mlp(), config=config)
    n, rank = comm.get_world_size(), comm.get_rank()
    for step, index in enumerate(batches):
        x, y = global_batch(index, 4 * n)
        loss = F.mse_loss(engine(x[rank * 4:(rank + 1) * 4]).float(), y[rank * 4:(rank + 1) * 4])
        if step == poison and rank == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
    return engine


@distributed_test(world_size=2, timeout=150)
@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_a_nan_loss_on_one_rank_skips_the_step_everywhere_and_names_it(stage, precision):
    config = base_config(stage, **({"bf16": {"enabled": True}} if precision == "bf16" else {}))
    with captured_logs() as lines:
        engine = _train(config, [0, 1, 2], poison=1)
    weights = engine.module_state_dict()
    assert engine.skipped_steps == 1 and engine.global_steps == 3
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    if comm.get_rank() == 0:
        assert any("step 2: a non-finite loss on rank(s) [1]" in line and "every rank skipped the step" in line
                   for line in lines), lines
    engine.destroy()
    expected = _train(config, [0, 2]).module_state_dict()  # the step never happened
    for name in weights:
        assert torch.equal(weights[name], expected[name]), name


@distributed_test(world_size=2, timeout=120)
def test_nonfinite_gradients_raise_on_every_rank_when_configured():
    config = base_config(2, zerodist={"nonfinite_gradients": "raise"})
    with pytest.raises(NonFiniteError, match=r"step 2: a non-finite loss on rank\(s\) \[1\]"):
        _train(config, [0, 1], poison=1)
