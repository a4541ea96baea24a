"""Hugging Face models built under `zerodist.zero.Init()`: the values of an eager build, bitwise."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config
from tests.harness import distributed_test
from tests.hf_models import KINDS, hf_batch, hf_class, hf_config, hf_loss, tied_pairs
from zerodist.zero import Init
from zerodist.zero.replay_init import InitReplayError

pytest.importorskip("transformers")

STAGE3 = base_config(3, zero_optimization={"stage3_param_persistence_threshold": 0})
STAGE3_SGD = {**STAGE3, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}


@pytest.mark.unit
@pytest.mark.parametrize("kind", [*KINDS, "mixtral"])
def test_partitioned_build_replays_the_models_own_initialisation(kind):
    """One process: every parameter and buffer (rotary tables, position ids) as the eager build,
    the RNG stream left where the eager build leaves it, ties as in the eager build."""
    from zerodist.zero.partition import _materialise

    config = hf_config(kind, tie_word_embeddings=True)
    torch.manual_seed(3)
    eager = hf_class(kind)(config)
    after_eager = torch.get_rng_state()
    torch.manual_seed(3)
    with Init():
        lazy = hf_class(kind)(config)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    assert tied_pairs(lazy) == tied_pairs(eager) != []
    for name, module in lazy.named_modules():
        _materialise(module, name, torch.device("cpu"))
    expected = dict(eager.named_buffers()) | eager.state_dict()
    actual = dict(lazy.named_buffers()) | lazy.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _train(engine, steps: int) -> dict[str, torch.Tensor]:
    n, rank, micro = comm.get_world_size(), comm.get_rank(), engine.batch.micro_batch_size
    for step in range(steps):
        ids = hf_batch(step, micro * n)
        engine.backward(hf_loss(engine, ids[rank * micro:(rank + 1) * micro]))
        engine.step()
    return engine.module_state_dict()


@pytest.mark.parametrize("kind", KINDS)
@distributed_test(world_size=2)
def test_partitioned_build_at_stage_3_equals_eager_and_trains_alike(kind):
    """Built under Init on 2 ranks: the eager build's state, bitwise; 5 steps bitwise equal to the
    eager build's run through the same engine, and within 1e-6 of a one-process run (absolute). SGD with
    momentum, not Adam: gradients that are zero in exact arithmetic (GPT-2's key bias) are
    rounding noise whose sign Adam turns into full-size steps, so no two summation orders agree."""
    config = hf_config(kind)
    torch.manual_seed(11)
    eager = hf_class(kind)(config)
    reference = hf_class(kind)(config)
    reference.load_state_dict(eager.state_dict())
    torch.manual_seed(11)
    with Init():
        model = hf_class(kind)(config)
    torch.manual_seed(999)  # what happens to the RNG between the build and initialize does not matter
    engine, _, _, _ = zerodist.initialize(model=model, config=STAGE3_SGD)
    initial = engine.module_state_dict()
    assert initial.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(initial[key], value), key

    trained = _train(engine, 5)
    eager_trained = _train(zerodist.initialize(model=eager, config=STAGE3_SGD)[0], 5)
    for key, value in eager_trained.items():
        assert torch.equal(trained[key], value), key
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        optimizer.zero_grad()
        hf_loss(reference, hf_batch(step, engine.batch.train_batch_size)).backward()
        optimizer.step()
    for key, value in reference.state_dict().items():
        # absolute: biases whose exact gradient is zero (the attention key's) hold only rounding noise
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6, msg=key)
    assert tied_pairs(model) == tied_pairs(reference)


@distributed_test(world_size=2)
def test_gpt2_tied_head_stays_tied_through_training():
    config = hf_config("gpt2")
    with Init():
        model = hf_class("gpt2")(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    engine, _, _, _ = zerodist.initialize(model=model, config=STAGE3)
    for step in range(2):
        engine.backward(hf_loss(engine, hf_batch(step, 4)))
        engine.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    state = engine.module_state_dict()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


@distributed_test(world_size=2)
def test_a_tensor_without_a_recorded_history_is_named():
    made_outside = torch.empty(4, device="meta")
    with Init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[1].register_buffer("table", made_outside)
    with pytest.raises(InitReplayError, match=r"buffer 'table' of module '1' \(Linear\).*not created under "
                                              r"zerodist.zero.Init"):
        zerodist.initialize(model=model, config=STAGE3)
