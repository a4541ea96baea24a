"""`engine.coalesce_grad_reduction()` (DeepSpeed's block for one optimizer step's several
`backward()` calls) on 2 gloo ranks, compared with one process that sums the same gradients: the
`step()` after the block applies the sum of the block's gradients, averaged over the ranks (stage 1
accumulates locally inside and reduces once on exit; stages 2/3 reduce into their shards as usual). The accumulation
boundary is never touched (DeepSpeed's documented use: `gradient_accumulation_steps` 1, several
backwards in the block, then `step()`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.engine import deepspeed_tensors as ds
from zerodist.models import make_mlp
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

ROWS = 4  # per rank and backward
CHUNKS = 4  # backwards per block
LR = 0.1
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


def _config(stage: int, gas: int = 1, **zero: object) -> dict:
    # plain SGD: the step moves each parameter by lr * gradient, so a wrong gradient shows in the parameters
    return base_config(stage, gradient_accumulation_steps=gas, optimizer={"type": "SGD", "params": {"lr": LR}},
                       zero_optimization={"stage": stage, **zero})


def _chunk(step: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(100 * step + chunk, ROWS * 2)


def _reference(steps: int, gas: int = 1) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process: each step's gradient (the sum over the chunks of the global chunk's mean loss,
    divided by the accumulation steps, as engine.backward scales) and the parameters after them."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(steps):
        for chunk in range(CHUNKS):
            x, y = _chunk(step, chunk)
            (F.mse_loss(model(x), y) / gas).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, {name: p.detach().clone() for name, p in model.state_dict().items()}


def _backward(engine: object, step: int, chunk: int) -> None:
    rank = comm.get_rank()
    x, y = _chunk(step, chunk)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    engine.backward(F.mse_loss(engine(x[rows]), y[rows]))


@pytest.mark.parametrize("stage,reduce_scatter", [(1, True), (1, False), (2, True), (3, True)])
@distributed_test(world_size=2)
def test_block_reduces_the_sum_of_its_backwards_once(stage, reduce_scatter):
    """Two steps, each one block of four backwards then step(): at stage 1 no gradient collective
    inside the block; after it the reduced gradient is the one-process sum over the four chunks, and the
    parameters after each step are the one process's."""
    grads, final = _reference(2)
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=_config(stage, reduce_scatter=reduce_scatter))
    params = dict(engine.module.named_parameters())
    for step in range(2):
        with engine.coalesce_grad_reduction():
            with comm.trace(ops=REDUCTIONS) as inside:
                for chunk in range(CHUNKS):
                    _backward(engine, step, chunk)
            if stage == 1:  # nothing reduced inside the block (stages 2/3 reduce each bucket as it fills)
                assert not inside.records, inside.format_summary()
        for name, param in params.items():
            torch.testing.assert_close(ds.safe_get_full_grad(param), grads[step][name], rtol=0, atol=1e-6)
        engine.step()
        assert engine.global_steps == step + 1
    for name, value in engine.module_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-6)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
@distributed_test(world_size=2)
def test_blocks_within_an_accumulation(stage):
    """gradient_accumulation_steps 2, one block of two backwards per micro-step: the step applies
    the four backwards' sum (each scaled by 1/2), as without the blocks."""
    grads, final = _reference(1, gas=2)
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=_config(stage, gas=2))
    for micro in range(2):
        with engine.coalesce_grad_reduction():
            for chunk in (2 * micro, 2 * micro + 1):
                _backward(engine, 0, chunk)
        engine.step()
    assert engine.global_steps == 1
    for name, value in engine.module_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-6)
    engine.destroy()


@distributed_test(world_size=2)
def test_refusals_are_named_on_every_rank():
    """DeepSpeed's checks, each raised by every rank from local state (no collective, no hang):
    stage 0, step() inside the block, no_sync() inside it and it inside no_sync(); the engine
    still trains afterwards."""
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=_config(0))
    with pytest.raises(NotImplementedError, match="stage 1/2/3"):
        with engine.coalesce_grad_reduction():
            pass
    engine.destroy()
    grads, final = _reference(1)
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=_config(1))
    with engine.no_sync(), pytest.raises(AssertionError, match="nested"):
        with engine.coalesce_grad_reduction():
            pass
    with engine.coalesce_grad_reduction():
        for chunk in range(CHUNKS):
            _backward(engine, 0, chunk)
        with pytest.raises(AssertionError, match="step\\(\\) inside .*no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync\\(\\) cannot be nested"):
            with engine.no_sync():
                pass
    engine.step()
    for name, value in engine.module_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-6)
    engine.destroy()
