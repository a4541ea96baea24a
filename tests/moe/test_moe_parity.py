"""Expert parallelism at the layer level: ep_size=2 on 2 ranks against ep_size=1 in one process fed
each rank's micro-batch; all-to-all traffic from the tracer; ranks that disagree get a named error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodist.comm as comm
from tests.harness import distributed_test
from zerodist.moe.layer import MoE, MoEShapeMismatchError

pytestmark = pytest.mark.multiprocess

HIDDEN, NUM_EXPERTS, TOKENS, AUX_COEF = 8, 4, 12, 0.1
_TOPOLOGIES: dict[int, comm.Topology] = {}


def _topology(expert: int) -> comm.Topology:
    # Building a Topology creates process groups: one per worker process and degree is enough.
    if expert not in _TOPOLOGIES:
        _TOPOLOGIES[expert] = comm.Topology(expert=expert)
    return _TOPOLOGIES[expert]


def _build(ep_size, **options):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))
    return MoE(HIDDEN, expert, num_experts=NUM_EXPERTS, ep_size=ep_size, **options)


def _pair(**options):
    """(reference at ep=1 with distinct experts, this rank's ep=2 layer holding its global experts)."""
    reference = _build(1, **options)
    with torch.no_grad():
        for param in reference.deepspeed_moe.experts.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    layer = _build(2, **options)
    layer.set_topology(_topology(2))
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(reference.deepspeed_moe.gate.wg.weight)
        for local, global_id in enumerate(layer.global_expert_ids()):
            source = reference.deepspeed_moe.experts.deepspeed_experts[global_id]
            layer.deepspeed_moe.experts.deepspeed_experts[local].load_state_dict(source.state_dict())
    return reference, layer


def _batch(shard, tokens=TOKENS):
    # requires_grad, as the output of an earlier layer: the dispatch all-to-all then has a backward.
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + shard)).requires_grad_()


def _loss(output, l_aux):
    return output.square().mean() + AUX_COEF * l_aux


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("random", [False, True])
@distributed_test(world_size=2)
def test_ep2_matches_one_process_reference(k, drop_tokens, random):
    options = dict(k=k, drop_tokens=drop_tokens, capacity_factor=0.75, min_capacity=0, use_rts=random,
                   top2_2nd_expert_sampling=random, noisy_gate_policy="Jitter" if random else None)
    reference, layer = _pair(**options)
    rank = comm.get_rank()
    layer.set_routing_key(step=3)
    inputs = _batch(rank)
    output, l_aux, exp_counts = layer(inputs)
    _loss(output, l_aux).backward()
    # The engine's reduction, by hand: every gradient is summed over its domain's axes and divided by
    # the number of batch shards (data x expert = 2): the gate over both ranks, experts over
    # ("data",), a group of one here.
    for param in layer.parameters():
        domain_group = _topology(2).group("data") if param in set(layer.deepspeed_moe.experts.parameters()) else None
        comm.all_reduce(param.grad, group=domain_group)
        param.grad.div_(2)
    results, reference_inputs = [], [_batch(shard) for shard in range(2)]
    for shard in range(2):
        reference.set_routing_key(shard=shard, step=3)
        results.append(reference(reference_inputs[shard]))
    (sum(_loss(out, aux) for out, aux, _ in results) / 2).backward()
    expected_output, expected_aux, expected_counts = results[rank]
    assert torch.equal(output, expected_output) and torch.equal(l_aux, expected_aux)
    assert torch.equal(exp_counts, expected_counts)
    assert (layer.last_stats.num_dropped > 0) == drop_tokens
    # The reference averages two shards' losses, so its input gradient is half this rank's.
    assert torch.allclose(inputs.grad, 2 * reference_inputs[rank].grad, rtol=1e-6, atol=1e-7)
    gate, expected_gate = layer.deepspeed_moe.gate.wg.weight.grad, reference.deepspeed_moe.gate.wg.weight.grad
    assert torch.allclose(gate, expected_gate, rtol=1e-6, atol=1e-7)
    for local, global_id in enumerate(layer.global_expert_ids()):
        mine = layer.deepspeed_moe.experts.deepspeed_experts[local]
        theirs = reference.deepspeed_moe.experts.deepspeed_experts[global_id]
        for (name, param), expected in zip(mine.named_parameters(), theirs.parameters()):
            assert torch.allclose(param.grad, expected.grad, rtol=1e-6, atol=1e-7), (global_id, name)


@pytest.mark.parametrize("k", [1, 2])
@distributed_test(world_size=2)
def test_capacity_mode_moves_four_all_to_alls_of_e_c_m(k):
    _, layer = _pair(k=k, capacity_factor=1.0, min_capacity=0)
    with comm.trace(ops=["all_to_all"]) as trace:
        output, l_aux, _ = layer(_batch(comm.get_rank()))
        _loss(output, l_aux).backward()
    capacity = -(-k * TOKENS // NUM_EXPERTS)
    assert [r.numel for r in trace.records] == [NUM_EXPERTS * capacity * HIDDEN] * 4
    assert trace.bus_elements() == 4 * NUM_EXPERTS * capacity * HIDDEN * (2 - 1) / 2
    assert layer.last_stats.all_to_all_elements == 2 * NUM_EXPERTS * capacity * HIDDEN


@distributed_test(world_size=2)
def test_dropless_moves_exactly_the_routed_rows_and_accepts_different_token_counts():
    reference, layer = _pair(k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
    rank = comm.get_rank()
    tokens = TOKENS + 5 * rank  # ranks hold different token counts: fine without capacities
    with comm.trace(ops=["all_to_all"]) as trace:
        output, l_aux, _ = layer(_batch(rank, tokens))
        _loss(output, l_aux).backward()
    counts, *rows = [r.numel for r in trace.records]
    assert counts == NUM_EXPERTS and len(rows) == 4
    sent_forward, returned_forward = rows[0], rows[1]
    received = returned_forward  # the return trip sends back what this rank's experts received
    assert sent_forward == tokens * 2 * HIDDEN  # exactly S * k rows, no padding
    peers = [None, None]
    comm.all_gather_object(peers, (sent_forward, received))
    assert sum(p[0] for p in peers) == sum(p[1] for p in peers)
    reference.set_routing_key(shard=rank)
    expected, _, _ = reference(_batch(rank, tokens))
    assert torch.equal(output, expected)


@distributed_test(world_size=2, timeout=60)
def test_ranks_disagreeing_on_token_count_get_a_named_error():
    _, layer = _pair(k=1)
    rank = comm.get_rank()
    # First forward: the whole signature through the store, with a deadline.
    with pytest.raises(MoEShapeMismatchError, match=r"rank 0: \('capacity', 12, .*; rank 1: \('capacity', 16"):
        layer(_batch(rank, TOKENS + 4 * rank))
    output, _, _ = layer(_batch(rank))  # the group is still usable
    assert output.shape == (TOKENS, HIDDEN)
    # Later forwards: token count and capacity in one small all_gather.
    with pytest.raises(MoEShapeMismatchError, match="rank 0: tokens 12, capacity 4; rank 1: tokens 20, capacity 5"):
        layer(_batch(rank, TOKENS + 8 * rank))
    output, _, _ = layer(_batch(rank))
    assert output.shape == (TOKENS, HIDDEN)
