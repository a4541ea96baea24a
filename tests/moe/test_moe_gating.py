"""Gating goldens (zerodist/moe/gating.py): pure, no processes. Expected values are hand-computed."""

import math

import pytest
import torch

from zerodist.moe.gating import Draws, GateSettings, RoutingKey, TopKGate, capacity, route

pytestmark = pytest.mark.unit


def _route(logits, training=True, key=None, used_token=None, **settings):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    gate = GateSettings(num_experts=logits.shape[1], **settings)
    generator = (key or RoutingKey()).generator()
    return route(logits, gate, training=training, draws=Draws(generator, logits.device), used_token=used_token)


def _kept_pairs(routing):
    """{(token, expert): slot} of the kept routes."""
    found = {}
    for s, j in routing.kept.nonzero().tolist():
        found[(s, int(routing.expert[s, j]))] = int(routing.slot[s, j])
    return found


@pytest.mark.parametrize("args, expected", [
    ((10, 4, 1, 1.0, 4), 4),      # ceil(2.5) = 3 < min 4
    ((100, 8, 2, 1.25, 4), 32),   # ceil(2 * 1.25 * 100 / 8) = ceil(31.25)
    ((8, 2, 2, 1.0, 0), 8),
    ((3, 1, 1, 2.0, 4), 3),       # 6 and min 4, clamped to S = 3
    ((10, 11, 1, 1.1, 0), 1),     # float noise (1.0000000000000002) must not add a slot
    ((12, 4, 3, 1.0, 0), 9),
])
def test_capacity(args, expected):
    assert capacity(*args) == expected


def test_uniform_routing_gives_l_aux_one_for_top1_and_counts_sum_to_s_times_k():
    num_experts, num_tokens = 4, 16
    logits = 10.0 * torch.nn.functional.one_hot(torch.arange(num_tokens) % num_experts, num_experts).float()
    routing = _route(logits, k=1, use_rts=False, min_capacity=0)
    assert routing.l_aux.item() == pytest.approx(1.0, abs=1e-6)
    assert routing.exp_counts.tolist() == [4, 4, 4, 4]
    top2 = _route(logits, k=2, top2_2nd_expert_sampling=False, min_capacity=0)
    assert int(top2.exp_counts.sum()) == num_tokens * 2
    assert top2.l_aux.item() == pytest.approx(1.0, abs=1e-6)  # first choices only, like top-1


def test_all_tokens_to_one_expert_gives_e_times_mean_gate():
    logits = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.5, 0.0], [3.0, 1.0, 2.0]])
    routing = _route(logits, k=1, use_rts=False)
    me0 = torch.softmax(logits, dim=1)[:, 0].mean()
    assert routing.l_aux.item() == pytest.approx(3 * me0.item(), rel=1e-6)
    assert routing.exp_counts.tolist() == [3, 0, 0]


def test_top1_position_policy_keeps_the_first_tokens_and_weights_are_raw_probs():
    experts = torch.tensor([0, 0, 0, 1, 0, 1])
    logits = 5.0 * torch.nn.functional.one_hot(experts, 2).float()
    routing = _route(logits, k=1, use_rts=False, capacity_factor=0.5, min_capacity=0)  # C = ceil(1.5) = 2
    assert routing.capacity == 2
    assert _kept_pairs(routing) == {(0, 0): 0, (1, 0): 1, (3, 1): 0, (5, 1): 1}
    assert routing.exp_counts.tolist() == [4, 2]
    assert routing.num_dropped == 2
    probs = torch.softmax(logits, dim=1).max(dim=1).values
    assert torch.equal(routing.weight[:, 0], probs * routing.kept[:, 0])


def test_ties_are_broken_by_position_and_lowest_expert():
    routing = _route(torch.zeros(8, 4), k=1, use_rts=False, min_capacity=0)  # C = 2, every gate equal
    assert routing.expert[:, 0].tolist() == [0] * 8
    assert _kept_pairs(routing) == {(0, 0): 0, (1, 0): 1}


def test_top2_second_choices_queue_after_all_first_choices():
    # first choices [0, 0, 1, 0]; with E = 2 the second choice is the other expert.
    logits = torch.tensor([[2.0, 1.0], [3.0, 0.0], [0.0, 1.0], [1.0, 0.5]])
    routing = _route(logits, k=2, top2_2nd_expert_sampling=False, capacity_factor=0.5, min_capacity=0)
    assert routing.capacity == 2
    assert _kept_pairs(routing) == {(0, 0): 0, (1, 0): 1, (2, 1): 0, (0, 1): 1}
    gates = torch.softmax(logits, dim=1)
    assert routing.weight[0].tolist() == pytest.approx((gates[0] / gates[0].sum()).tolist())
    assert routing.weight[1].tolist() == pytest.approx([1.0, 0.0])  # renormalised over the kept route
    assert routing.weight[3].tolist() == [0.0, 0.0]
    me = gates.mean(dim=0)
    ce = torch.tensor([3 / 4, 1 / 4])
    assert routing.l_aux.item() == pytest.approx((2 * (me * ce).sum()).item(), rel=1e-6)


# Each token's logits are [3, 2, 1, 0] rotated, so every expert is chosen by 3 of the 4 tokens.
_CYCLIC = torch.stack([torch.roll(torch.tensor([3.0, 2.0, 1.0, 0.0]), s) for s in range(4)])


def test_topk_probs_policy_keeps_the_highest_gates():
    routing = _route(_CYCLIC, k=3, capacity_factor=0.5, min_capacity=0, drop_policy="probs")  # C = 2
    assert routing.capacity == 2
    assert _kept_pairs(routing) == {(0, 0): 0, (3, 0): 1, (0, 1): 0, (1, 1): 1,
                                    (1, 2): 0, (2, 2): 1, (2, 3): 0, (3, 3): 1}
    assert routing.l_aux.item() == pytest.approx(1.0, abs=1e-6)  # balanced: E * sum(me * ce) / k = 1
    assert routing.exp_counts.tolist() == [3, 3, 3, 3]


def test_topk_position_policy_keeps_the_first_tokens():
    routing = _route(_CYCLIC, k=3, capacity_factor=0.5, min_capacity=0, drop_policy="position")
    assert _kept_pairs(routing) == {(0, 0): 0, (2, 0): 1, (0, 1): 0, (1, 1): 1,
                                    (0, 2): 0, (1, 2): 1, (1, 3): 0, (2, 3): 1}
    # Token 3's three routes all come last for their experts: it is dropped entirely.
    assert torch.allclose(routing.weight.sum(dim=1), torch.tensor([1.0, 1.0, 1.0, 0.0]))


def test_random_choices_follow_the_key_only():
    logits = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    key = RoutingKey(seed=7, layer=1, shard=1, step=3)
    first = _route(logits, k=1, key=key, min_capacity=0, noisy_gate_policy="RSample")
    again = _route(logits, k=1, key=RoutingKey(seed=7, layer=1, shard=1, step=3), min_capacity=0,
                   noisy_gate_policy="RSample")
    other = _route(logits, k=1, key=RoutingKey(seed=7, layer=1, shard=0, step=3), min_capacity=0,
                   noisy_gate_policy="RSample")
    assert torch.equal(first.expert, again.expert) and torch.equal(first.kept, again.kept)
    assert not torch.equal(first.expert, other.expert)
    assert int(first.kept.sum()) == sum(min(c, first.capacity) for c in first.exp_counts.tolist())


def test_capacity_above_token_count_and_dropless_and_used_token():
    logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    small = _route(logits, k=1, min_capacity=4)  # DeepSpeed asked topk for 4 of 2 rows (#5353)
    assert small.capacity == 2 and bool(small.kept.all())
    dropless = _route(torch.zeros(6, 2), k=1, drop_tokens=False)
    assert dropless.capacity is None and bool(dropless.kept.all())
    used = torch.tensor([1, 0, 1, 1, 0, 1])
    masked = _route(torch.zeros(6, 2), k=1, use_rts=False, min_capacity=6, used_token=used)
    assert masked.kept[:, 0].tolist() == [True, False, True, True, False, True]
    assert masked.exp_counts.tolist() == [4, 0]


def test_gate_runs_in_fp32_and_validates():
    gate = TopKGate(8, GateSettings(num_experts=4, k=2))
    routing = gate(torch.randn(6, 8, dtype=torch.bfloat16))
    assert routing.weight.dtype == torch.float32 and routing.l_aux.dtype == torch.float32
    with pytest.raises(ValueError, match="k must be an int between 1 and num_experts"):
        GateSettings(num_experts=2, k=3)
    with pytest.raises(ValueError, match="drop_policy"):
        GateSettings(num_experts=2, drop_policy="random")
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        GateSettings(num_experts=2, noisy_gate_policy="Gumbel")
    assert math.isfinite(routing.l_aux.item())
