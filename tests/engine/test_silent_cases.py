"""What used to pass without a word: a layer the user made fp16 cast to the config's dtype, and a
parameter unused in a step still moved by Adam (documented in README's guarantees)."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import make_mlp
from tests.debug_helpers import captured_logs
from tests.engine_helpers import base_config
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess


def _recast_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("initialize(): the model holds")]


@distributed_test(world_size=2)
def test_a_layer_made_fp16_is_named_when_cast_to_the_configs_dtype():
    model = make_mlp()
    model[2].half()
    model[4].bfloat16()
    with captured_logs() as messages:
        engine, *_ = zerodist.initialize(model=model, config=base_config(2))
    warned = _recast_warnings(messages)
    if comm.get_rank() == 0:
        assert warned == [
            "initialize(): the model holds float16 in module '2'; bfloat16 in module '4'; the config trains in fp32, "
            "so they are cast to float32 (every trained parameter has the one dtype the config's \"bf16\"/\"fp16\" "
            "sections choose). Build those modules in float32 to silence this."], messages
    else:
        assert warned == []  # said once, by rank 0
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    engine.destroy()

    # Nothing the user chose is changed in these: an fp32 model in bf16 training (the cast mixed
    # precision means), and a model already in the config's dtype.
    for model, config in ((make_mlp(), base_config(2, bf16={"enabled": True})),
                          (make_mlp().bfloat16(), base_config(2, bf16={"enabled": True}))):
        with captured_logs() as messages:
            engine, *_ = zerodist.initialize(model=model, config=config)
        assert _recast_warnings(messages) == []
        engine.destroy()


@distributed_test(world_size=2)
def test_a_parameter_unused_in_a_step_gets_a_zero_gradient_and_adam_still_moves_it():
    """The documented difference from torch.optim, which skips a parameter whose grad is None."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    config = base_config(2, optimizer={"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False}})
    engine, *_ = zerodist.initialize(model=model, config=config)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(comm.get_rank()))
    engine.backward(model["unused"](model["used"](x)).sum())  # step 1: both used
    engine.step()
    after_first = model["unused"].weight.detach().clone()
    engine.backward(model["used"](x).sum())  # step 2: "unused" takes no part on any rank
    engine.step()
    assert not torch.equal(model["unused"].weight, after_first)  # momentum from step 1 moved it
    engine.destroy()
