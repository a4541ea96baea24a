"""DeepSpeed's activation checkpointing of a PipelineModule (`activation_checkpoint_interval`,
`activation_checkpoint_func`, `checkpointable_layers`, the config's `pipeline` section) and
batches whose shapes change between steps (`dynamic_shape`).

The bar: on 2 pipe ranks, training with checkpointing (reentrant, from the config; non-reentrant,
from the module's arguments; at ZeRO 0 and 3) gives bitwise the parameters of training without it, and the
checkpointed blocks really are recomputed (their forward runs twice per micro-batch); micro-batches
of changing sizes train to one process' gradient accumulation's parameters within 1e-6."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from zerodist.pipe import PipelineModule
from zerodist.runtime.activation_checkpointing import checkpointing

WIDTH, LAYERS, MICRO, GAS, STEPS = 8, 6, 4, 2, 3


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS)]


def batch(step: int, micro: int, rows: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def config(pipeline: dict | None = None, stage: int = 0) -> dict:
    settings = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                "steps_per_print": 10**9, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": stage}}
    if pipeline is not None:
        settings["pipeline"] = pipeline
    return settings


# ---------------------------------------------------------------------------- one process

@pytest.mark.unit
def test_blocks_are_checkpointed_by_deepspeeds_rule():
    mixed = [torch.nn.ReLU(), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    module = PipelineModule(mixed, num_stages=1, activation_checkpoint_interval=2)
    assert module.is_checkpointable_results == [False, True]  # a block with parameters is checkpointed
    assert module.activation_checkpoint_func is checkpointing.checkpoint  # DeepSpeed's default
    module.set_checkpoint_interval(1)
    assert module.activation_checkpoint_interval == 1
    assert module.is_checkpointable_results == [False, False, True, True]
    named = PipelineModule(mixed, num_stages=1, activation_checkpoint_interval=1, checkpointable_layers=["ReLU"])
    assert named.is_checkpointable_results == [True, True, False, False]
    module.set_checkpoint_interval(0)
    assert module.is_checkpointable_results == []


@pytest.mark.unit
@pytest.mark.parametrize("interval", [-1, 1.5, True])
def test_a_bad_interval_is_refused_naming_it(interval):
    with pytest.raises(ValueError, match="activation_checkpoint_interval takes an int >= 0"):
        PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, activation_checkpoint_interval=interval)
    module = PipelineModule([torch.nn.Linear(2, 2)], num_stages=1)
    with pytest.raises(ValueError, match="activation_checkpoint_interval takes an int >= 0"):
        module.set_checkpoint_interval(interval)


@pytest.mark.unit
@pytest.mark.parametrize("function", [None, checkpointing.non_reentrant_checkpoint])
def test_one_stage_gradients_equal_without_checkpointing(function):
    """The first block's inputs need no grad: reentrant recomputation still gives its parameters
    their gradients (the module hands it inputs that require grad), and token ids (no floating
    input) go through the non-reentrant checkpoint."""
    def grads(interval: int, ids: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        head = [torch.nn.Embedding(10, WIDTH)] if ids else []
        module = PipelineModule(head + layers(), num_stages=1, activation_checkpoint_interval=interval,
                                activation_checkpoint_func=function)
        x = torch.arange(8).remainder(10).view(2, 4) if ids else batch(0, 0)[0]
        module(x).square().mean().backward()
        return [p.grad.clone() for p in module.parameters()]

    for ids in (False, True):
        plain, checkpointed = grads(0, ids), grads(2, ids)
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))


# ---------------------------------------------------------------------------- two pipe ranks
def train_body(interval: int, pipeline: dict | None, function_name: str | None,
               stage: int = 0) -> tuple[list, int, bool]:
    function = None if function_name is None else getattr(checkpointing, function_name)
    module = PipelineModule(layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform",
                            activation_checkpoint_interval=interval, activation_checkpoint_func=function)
    calls = [0]
    first = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    engine, *_ = zerodist.initialize(model=module, config=config(pipeline, stage))
    for step in range(STEPS):
        engine.train_batch(iter([batch(step, micro) for micro in range(GAS)]))
    state = [(k, v.clone()) for k, v in engine.module_state_dict().items()]
    reentrant = engine._reentrant_activation_checkpointing()
    engine.destroy()
    return state, calls[0], reentrant


@pytest.mark.parametrize("interval, pipeline, function_name, reentrant", [
    (0, {"activation_checkpoint_interval": 1}, None, True),  # the config's interval, DeepSpeed's reentrant default
    (2, {"use_reentrant": False}, None, False),  # the module's interval, the config's non-reentrant function
    (1, None, "non_reentrant_checkpoint", False),  # the module's own arguments
])
def test_pipe2_checkpointing_gives_bitwise_the_parameters_without_it(interval, pipeline, function_name, reentrant):
    plain = run_distributed(train_body, 2, 0, None, None)
    checkpointed = run_distributed(train_body, 2, interval, pipeline, function_name)
    for (state, calls, _), (ref_state, ref_calls, ref_reentrant) in zip(checkpointed, plain, strict=True):
        assert not ref_reentrant
        assert [k for k, _ in state] == [k for k, _ in ref_state]
        assert all(torch.equal(v, r) for (_, v), (_, r) in zip(state, ref_state, strict=True))
        assert ref_calls == STEPS * GAS and calls == 2 * STEPS * GAS  # recomputed in the backward pass
    assert [r[2] for r in checkpointed] == [reentrant, reentrant]


def test_pipe2_zero3_checkpointing_gives_bitwise_the_parameters_without_it():
    """ZeRO-3 gathers a checkpointed block's parameters again for its recomputation."""
    plain = run_distributed(train_body, 2, 0, None, None, 3)
    checkpointed = run_distributed(train_body, 2, 0, {"activation_checkpoint_interval": 2}, None, 3)
    for (state, calls, reentrant), (ref_state, ref_calls, _) in zip(checkpointed, plain, strict=True):
        assert all(torch.equal(v, r) for (_, v), (_, r) in zip(state, ref_state, strict=True))
        assert reentrant and calls == 2 * ref_calls


# ---------------------------------------------------------------------------- changing shapes
ROWS = [[1, 3], [5, 2], [4, 4]]  # rows of each step's micro-batches


def dynamic_body() -> list[tuple[str, torch.Tensor]]:
    module = PipelineModule(layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform",
                            dynamic_shape=True)
    assert module.dynamic_shape
    engine, *_ = zerodist.initialize(model=module, config=config())
    for step, rows in enumerate(ROWS):
        engine.train_batch(iter([batch(step, micro, n) for micro, n in enumerate(rows)]))
    state = [(k, v.clone()) for k, v in engine.module_state_dict().items()]
    engine.destroy()
    return state


def test_pipe2_micro_batches_of_changing_shapes_equal_one_process():
    model = torch.nn.Sequential(*layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, rows in enumerate(ROWS):
        for micro, n in enumerate(rows):
            x, y = batch(step, micro, n)
            (torch.nn.functional.mse_loss(model(x), y) / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = model.state_dict()
    seen = set()
    for state in run_distributed(dynamic_body, 2):
        for key, value in state:
            seen.add(key)
            assert torch.allclose(value, reference[key], rtol=0, atol=1e-6), key
    assert seen == set(reference)
