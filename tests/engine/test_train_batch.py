"""`engine.train_batch()` without a pipeline: the plain accumulation loop of the engine's batch
runner (zerodist/engine/runners.py) equals the same micro-batches through forward, backward and
step, bitwise, on 2 gloo ranks at ZeRO 1 and 3; it returns the batch's loss averaged over the
micro-batches and the data-parallel ranks; `eval_batch` runs forwards only."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed

GAS = 2


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(GAS)]


def body(stage: int, whole: bool):
    torch.manual_seed(0)
    engine, *_ = zerodist.initialize(model=Regression(), config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}})
    rank, losses = engine.topology.batch_rank, []
    for step in range(3):
        if whole:
            losses.append(engine.train_batch(iter(batches(step, rank))).item())
        else:
            for x, y in batches(step, rank):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
    evaluated = engine.eval_batch(iter(batches(9, rank))).item()
    state = engine.module_state_dict()
    counters = (engine.global_steps, engine.micro_steps)
    engine.destroy()
    return state, losses, evaluated, counters


@pytest.mark.parametrize("stage", [1, 3])
def test_train_batch_is_the_accumulation_loop(stage):
    whole = run_distributed(body, 2, stage, True)
    plain = run_distributed(body, 2, stage, False)
    for (state, losses, evaluated, counters), (reference, _, reference_eval, reference_counters) in zip(whole, plain):
        assert counters == reference_counters == (3, 3 * GAS)
        assert all(torch.equal(state[k], reference[k]) for k in reference)  # bitwise
        assert evaluated == reference_eval
        assert losses == whole[0][1]  # the batch's loss, the same on every rank
