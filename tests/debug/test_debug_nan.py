"""NaN/Inf hunt: a NaN born on one rank, in one layer's output or one layer's backward, is
named with that rank and module or parameter, and every rank raises together."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodist
import zerodist.comm as comm
from zerodist.debug import NanHunter, NonFiniteError
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess


class Poison(nn.Module):
    """Turns its input into NaN from the `at`-th call on, when `active` (one rank only)."""

    def __init__(self, active: bool, at: int):
        super().__init__()
        self.active, self.at, self.calls = active, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.active and self.calls >= self.at else x


class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class GradPoison(nn.Module):
    """Identity forward; NaN gradient in backward, when `active`."""

    def __init__(self, active: bool):
        super().__init__()
        self.active = active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanGradient.apply(x) if self.active else x


def _model(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), middle, nn.ReLU(), nn.Linear(32, 8))


def _step(engine, step: int):
    x, y = global_batch(step, 8)
    rows = slice(4 * comm.get_rank(), 4 * comm.get_rank() + 4)
    loss = F.mse_loss(engine(x[rows]), y[rows])
    engine.backward(loss)
    engine.step()


@distributed_test(world_size=2)
def test_nan_from_one_layer_on_one_rank_is_named_on_every_rank():
    poison = Poison(active=comm.get_rank() == 1, at=3)
    engine, _, _, _ = zerodist.initialize(model=_model(poison), config=base_config(
        2, zerodist={"debug": {"nan_check": True}}))
    try:
        _step(engine, 0)
        _step(engine, 1)
        with pytest.raises(NonFiniteError) as caught:  # on both ranks, although rank 0 is clean
            _step(engine, 2)
        first = caught.value.findings[0]
        assert (first.rank, first.phase) == (1, "forward") and [f.rank for f in caught.value.findings] == [1]
        message = str(caught.value)
        assert "rank 1 went first: non-finite forward output: module '3' (Poison) (its inputs were finite)" in message
        assert "rank(s) 0: all finite" in message and "at micro-step 2 (optimizer step 2)" in message
        return message
    finally:
        engine.destroy()


@distributed_test(world_size=2)
def test_nan_born_in_backward_names_the_first_parameter_gradient():
    engine, _, _, _ = zerodist.initialize(model=_model(GradPoison(active=comm.get_rank() == 1)),
                                          config=base_config(1))
    hunter = NanHunter(engine)  # the explicit form: the engine's own nan_check is off here
    try:
        x, y = global_batch(0, 8)
        loss = F.mse_loss(engine(x[:4]), y[:4])
        engine.backward(loss)
        with pytest.raises(NonFiniteError) as caught:
            hunter.check(loss)
        first = caught.value.findings[0]
        # backward meets the last layer first (finite), then the poison: the layer before it goes first
        assert (first.rank, first.phase) == (1, "gradient") and first.where.startswith("non-finite gradient: '2.")
        message = str(caught.value)
        assert "rank 1 went first: non-finite gradient: '2." in message and "before reduction" in message
        assert "rank(s) 0: all finite" in message
        hunter.close()
        assert not engine.reducer.grad_observers
        return message
    finally:
        hunter.close()
        engine.destroy()


@distributed_test(world_size=1)
def test_plain_model_input_from_the_batch_and_hooks_removed():
    model = _model(nn.Identity())
    hunter = NanHunter(model)
    x = torch.randn(4, 16)
    x[1, 3] = float("inf")  # from the batch: the first module's inputs already were non-finite
    loss = model(x).sum()
    loss.backward()
    with pytest.raises(NonFiniteError, match=r"module '0' \(Linear\) \(its inputs were already non-finite"):
        hunter.check(loss)
    hunter.close()
    assert not model._forward_hooks and not model._forward_pre_hooks and not model[0]._forward_hooks
    assert all(not p._backward_hooks for p in model.parameters())
    model.zero_grad()
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    NanHunter(model, forward=False).check(loss)  # finite: no error
