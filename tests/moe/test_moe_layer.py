"""The MoE layer in one process: DeepSpeed's API, the naive per-token definition, the helpers."""

import logging

import pytest
import torch
from torch import nn

from zerodist.comm.domains import parameter_placements
from zerodist.comm.topology import DENSE, EXPERT
from zerodist.moe.layer import MoE
from zerodist.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param,
                                split_params_into_different_moe_groups_for_optimizer)

pytestmark = pytest.mark.unit


def _expert(hidden=8):
    return nn.Sequential(nn.Linear(hidden, 16), nn.GELU(), nn.Linear(16, hidden))


def _moe(seed=0, **kwargs):
    torch.manual_seed(seed)
    moe = MoE(8, _expert(), num_experts=4, **kwargs)
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as copies of one)
        for param in moe.deepspeed_moe.experts.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return moe


def _naive(moe, x):
    """out[s] = sum over kept routes j of weight[s, j] * expert[e](x[s]), computed token by token."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.deepspeed_moe.gate(tokens)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(tokens.shape[0]):
        row = torch.zeros(tokens.shape[1])
        for j in range(routing.expert.shape[1]):
            if routing.kept[s, j]:
                row = row + routing.weight[s, j] * experts[int(routing.expert[s, j])](tokens[s])
        rows.append(row)
    return torch.stack(rows).reshape(x.shape), routing


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_layer_matches_the_per_token_definition(k, drop_tokens):
    moe = _moe(k=k, drop_tokens=drop_tokens, capacity_factor=0.75, min_capacity=0, use_rts=False,
               top2_2nd_expert_sampling=False)
    x = torch.randn(2, 6, 8)
    moe.set_routing_key(step=5)
    output, l_aux, exp_counts = moe(x)
    moe.set_routing_key(step=5)
    expected, routing = _naive(moe, x)
    assert output.shape == x.shape
    assert torch.allclose(output, expected, atol=1e-6)
    assert torch.equal(l_aux, routing.l_aux) and torch.equal(exp_counts, routing.exp_counts)
    assert int(exp_counts.sum()) == 12 * k
    assert (moe.last_stats.num_dropped > 0) == drop_tokens  # cf 0.75 drops some routes here
    output.sum().backward()
    assert all(p.grad is not None for p in moe.parameters())


def test_dropless_equals_capacity_mode_when_nothing_is_dropped():
    x = torch.randn(10, 8)
    big = _moe(k=2, capacity_factor=4.0, top2_2nd_expert_sampling=False)
    dropless = _moe(k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
    out_big, aux_big, _ = big(x)
    out_dropless, aux_dropless, _ = dropless(x)
    assert big.last_stats.num_dropped == 0
    assert torch.allclose(out_big, out_dropless, atol=1e-6) and torch.equal(aux_big, aux_dropless)


def test_residual_moe_and_deepspeed_state_dict_keys():
    moe = _moe(use_residual=True)
    keys = set(moe.state_dict())
    assert "deepspeed_moe.gate.wg.weight" in keys
    assert "deepspeed_moe.experts.deepspeed_experts.3.2.bias" in keys
    assert {"mlp.0.weight", "coefficient.weight"} <= keys
    output, _, _ = moe(torch.randn(5, 8))
    assert output.shape == (5, 8)


def test_experts_are_recognised_structurally_and_declared_expert():
    moe = _moe(use_residual=True)
    experts = set(map(id, moe.deepspeed_moe.experts.parameters()))
    assert all(is_moe_param(p) == (id(p) in experts) for p in moe.parameters())
    assert not is_moe_param(moe.mlp[0].weight)  # the residual MLP is dense, as in DeepSpeed
    placements = parameter_placements(moe)
    assert {placements[i].domain for i in experts} == {EXPERT}
    assert placements[id(moe.deepspeed_moe.gate.wg.weight)].domain == DENSE
    assert not any(hasattr(p, "allreduce") or hasattr(p, "group_name") for p in moe.parameters())
    assert has_moe_layers(nn.Sequential(moe, nn.Linear(8, 8))) == (True, 1)


def test_split_params_into_moe_groups():
    moe = _moe()
    dense = [p for p in moe.parameters() if not is_moe_param(p)]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(moe.parameters()), "name": "all", "lr": 0.1}], max_group_size=16 * 8 + 16)
    assert groups[0]["params"] == dense and groups[0]["name"] == "all"
    expert_groups = groups[1:]
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in expert_groups)
    assert all(sum(p.numel() for p in g["params"]) <= 144 for g in expert_groups)
    assert sum(len(g["params"]) for g in expert_groups) == 4 * 4
    with pytest.raises(ValueError, match="has no 'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": dense}])
    configured = configure_moe_param_groups(list(moe.parameters()))
    assert configured[0]["name"] == "dense-params" and len(configured) == 2


def test_options_that_cannot_work_are_named(caplog):
    with pytest.raises(ValueError, match="divisible by ep_size"):
        MoE(8, _expert(), num_experts=3, ep_size=2)
    with caplog.at_level(logging.WARNING, logger="zerodist"):
        logging.getLogger("zerodist").propagate = True
        try:
            MoE(8, _expert(), num_experts=2, use_tutel=True)
        finally:
            logging.getLogger("zerodist").propagate = False
    assert "Tutel is not supported" in caplog.text
    layer = MoE(8, _expert(), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="no expert-parallel group"):
        layer(torch.randn(4, 8))


def test_aux_loss_free_bias_moves_by_exactly_coeff_and_only_steers_selection():
    torch.manual_seed(0)
    moe = MoE(8, _expert(), num_experts=4, k=1, use_rts=False, load_balance_coeff=0.01, drop_tokens=False)
    gate = moe.deepspeed_moe.gate
    with torch.no_grad():  # a skewed router: every token prefers expert 0, then 1
        gate.wg.weight.zero_()
        gate.wg.weight[0, 0], gate.wg.weight[1, 0] = 3.0, 2.0
    x = torch.ones(8, 8)
    moe(x)
    assert gate.tokens_per_expert.tolist() == [8, 0, 0, 0]
    change = moe.update_expert_bias()
    assert change.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert gate.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert gate.tokens_per_expert.tolist() == [0, 0, 0, 0]
    with torch.no_grad():
        gate.expert_bias.copy_(torch.tensor([-1.0, 0.0, 0.0, 0.0]))  # now expert 1 wins the selection
    moe(x)
    routing = gate(x)
    probs = torch.softmax(torch.nn.functional.linear(x, gate.wg.weight), dim=1)
    assert routing.expert[:, 0].tolist() == [1] * 8
    assert torch.allclose(routing.weight[:, 0], probs[:, 1])  # the gate value ignores the bias
    gate.tokens_per_expert.copy_(torch.tensor([2.0, 2.0, 2.0, 2.0]))
    assert moe.update_expert_bias().tolist() == [0.0, 0.0, 0.0, 0.0]  # balanced: no change
    assert "deepspeed_moe.gate.expert_bias" in moe.state_dict()
    assert "deepspeed_moe.gate.tokens_per_expert" not in moe.state_dict()
