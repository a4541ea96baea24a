"""Pipe x expert: the demo MoE GPT cut by `split_model` (its built-in plan carries the summed balance
loss between stages: [Note: MoE balance loss across stages] in zerodist/pipe/split_plans.py), each
stage's MoE layer over the expert group of that stage's ranks. pipe 2 x expert 2 on 4 gloo ranks,
ZeRO 1 and 3, 5 steps of SGD: parameters (experts under their global ids) within 1e-6 of the
unsplit model with every expert in one process, on the same global batch; and the triple pipe 2 x
data 2 x expert 2 on 8 ranks (ZeRO 1). Tokens are never
dropped and the balance loss has weight 0 here: capacity and the balance loss are statistics of
each rank's own tokens (as in DeepSpeed), so they differ from one process's by design."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, LR, STEPS, VOCAB, SEQ, config, micro_batch
from zerodist.models import GPTConfig
from zerodist.models.moe_gpt import MoEConfig, MoEGPT
from zerodist.pipe import split_model, token_cross_entropy

pytestmark = pytest.mark.slow


def build(ep_size: int) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2, dropout=0.0),
                  MoEConfig(num_experts=2, ep_size=ep_size, drop_tokens=False, aux_loss_coef=0.0))


def reference_body(shards: int):
    model = build(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, states = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            parts = [micro_batch(step, micro, d) for d in range(shards)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = token_cross_entropy(model(x), y)
            (loss / GAS).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses, states


def pipe_expert_body(stage: int, data: int = 1):
    module = split_model(build(2), num_stages=2)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(stage))
    degrees = dict(engine.topology.degrees)
    assert degrees == {"pipe": 2, "data": data, "expert": 2, "sequence": 1, "tensor": 1}, degrees
    shard = engine.topology.batch_rank  # expert ranks read different samples
    reports = engine.part_states.report()
    losses, states = [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter([micro_batch(step, m, shard) for m in range(GAS)])).item())
        states.append(engine.module_state_dict())  # experts under their global ids
    engine.destroy()
    return losses, states, reports


@pytest.mark.parametrize("stage, data", [(1, 1), (3, 1), (1, 2)])
def test_split_moe_gpt_pipe2_expert2_equals_one_process(stage, data):
    """pipe 2 x expert 2 (4 ranks), and the triple pipe 2 x data 2 x expert 2 (8 ranks, ZeRO 1): the
    batch is dealt over data x expert, so one process accumulates every shard's micro-batches."""
    (ref_losses, ref_states), = run_distributed(reference_body, 1, 2 * data)
    results = run_distributed(pipe_expert_body, 4 * data, stage, data, timeout=300)
    keys: set[str] = set()
    for losses, states, reports in results:
        assert any(line.startswith("expert parallel: 1 MoE layer(s), degree 2") for line in reports), reports
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for step, state in enumerate(states):
            keys |= set(state)
            for key, value in state.items():
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=1e-6), (step, key)
    assert keys == set(ref_states[0])  # every expert of every layer, under the one-process names
