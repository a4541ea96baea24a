"""MoE through zerodist.initialize at every ZeRO stage against one process at ep_size=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import assert_close_relative, base_config
from tests.harness import distributed_test
from zerodist.moe.layer import MoE

IN_DIM, HIDDEN, OUT_DIM, NUM_EXPERTS, MICRO, STEPS, AUX_COEF = 6, 8, 4, 4, 6, 5, 0.1


class MoEModel(nn.Module):
    """Linear -> MoE -> Linear, with a dense parameter and a buffer whose names contain 'expert'."""

    def __init__(self, ep_size: int, expert_rank: int, **options):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN_DIM, HIDDEN)
        self.expert_bias = nn.Parameter(torch.zeros(HIDDEN))
        self.register_buffer("experts_mask", torch.ones(HIDDEN))
        self.moe = MoE(HIDDEN, nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN)),
                       num_experts=NUM_EXPERTS, ep_size=ep_size, **options)
        self.out = nn.Linear(HIDDEN, OUT_DIM)
        local = NUM_EXPERTS // ep_size
        with torch.no_grad():  # distinct experts; expert g's values depend on g only
            for index, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                generator = torch.Generator().manual_seed(50 + expert_rank * local + index)
                for param in expert.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x, y):
        output, l_aux, _ = self.moe(self.inp(x) + self.expert_bias)
        return F.mse_loss(self.out(output * self.experts_mask), y) + AUX_COEF * l_aux


def _batch(step: int, shard: int):
    generator = torch.Generator().manual_seed(1000 + 10 * step + shard)
    return torch.randn(MICRO, IN_DIM, generator=generator), torch.randn(MICRO, OUT_DIM, generator=generator)


def _reference(num_shards: int, options: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = MoEModel(1, 0, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for shard in range(num_shards):
            model.moe.set_routing_key(shard=shard, step=step)
            losses.append(model(*_batch(step, shard)))
        (sum(losses) / num_shards).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(stage: int, ep_size: int, options: dict, steps: int = STEPS, **config):
    expert_rank = comm.get_rank() % ep_size
    model = MoEModel(ep_size, expert_rank, **options)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage, **config))
    shard = engine.topology.batch_rank
    for step in range(steps):
        loss = engine(*_batch(step, shard))
        engine.backward(loss)
        engine.step()
    return engine, engine.module_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("k, drop_tokens", [(1, True), (1, False), (2, True), (2, False)])
@distributed_test(world_size=2)
def test_ep2_training_matches_one_process(stage, k, drop_tokens):
    options = dict(k=k, drop_tokens=drop_tokens, capacity_factor=0.75, min_capacity=0)
    engine, state = _train(stage, 2, options)
    assert engine.topology.size("expert") == 2
    assert_close_relative(state, _reference(2, options), 1e-6)
