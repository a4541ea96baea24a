"""DeepSpeed's gating functions as `deepspeed.moe.sharded_moe` serves them: DeepSpeed's output
formats, and the same decisions as zerodist's own gate wherever DeepSpeed's rules and zerodist's
agree (no ties, no randomness, capacity within the token count)."""

import pytest
import torch

import zerodist.comm as comm
from zerodist.moe import sharded_moe
from zerodist.moe.gating import Draws, GateSettings, route
from zerodist.moe.sharded_moe import (_route_slots, _sparse_decode, _sparse_encode, top1gating, top2gating,
                                      topkgating)
from tests.harness import distributed_test

def _logits(tokens=16, experts=4, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def _dense_from_route(logits, k, capacity_factor, min_capacity, drop_policy="position"):
    """zerodist's `route` as DeepSpeed's combine_weights [S, E, C]."""
    settings = GateSettings(logits.shape[1], k, capacity_factor, capacity_factor, min_capacity, None, True, False,
                            False, drop_policy)
    routing = route(logits, settings, training=True, draws=Draws(None, logits.device))
    combine = torch.zeros(logits.shape[0], logits.shape[1], routing.capacity)
    for s, j in routing.kept.nonzero().tolist():
        combine[s, routing.expert[s, j], routing.slot[s, j]] = routing.weight[s, j]
    return routing, combine


@pytest.mark.unit
@pytest.mark.parametrize("k,policy", [(2, "position"), (3, "position"), (3, "probs")])
def test_same_decisions_as_zerodists_gate(k, policy):
    """Over-full experts drop routes the same way (no ties in random logits), slots and weights alike."""
    logits = _logits(tokens=24, experts=6, seed=k)
    if k == 2:
        l_aux, combine, dispatch, counts = top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    else:
        l_aux, combine, dispatch, counts = topkgating(logits, k, 0.5, 0, drop_policy=policy)
    routing, expected = _dense_from_route(logits, k, 0.5, 0, policy)
    assert routing.num_dropped > 0  # the capacity bites
    torch.testing.assert_close(combine, expected, atol=1e-7, rtol=0)
    assert torch.equal(dispatch, expected.bool())
    assert torch.equal(counts, routing.exp_counts)
    torch.testing.assert_close(l_aux, routing.l_aux)


@pytest.mark.unit
def test_top1_without_drops_matches_zerodists_gate():
    logits = _logits()
    l_aux, combine, _, counts = top1gating(logits, 4.0, 0, use_rts=False)
    routing, expected = _dense_from_route(logits, 1, 4.0, 0)
    torch.testing.assert_close(combine[..., : expected.shape[-1]], expected, atol=0, rtol=0)
    assert torch.equal(counts, routing.exp_counts)
    torch.testing.assert_close(l_aux, routing.l_aux)


@pytest.mark.unit
def test_capacity_sizes_the_buffer_beyond_the_token_count():
    """DeepSpeed's capacity is not clamped to S (zerodist's gate clamps): ceil(8 / 2 * 4) = 16 slots."""
    _, combine, dispatch, _ = top1gating(_logits(8, 2), capacity_factor=4.0, min_capacity=0, use_rts=False)
    assert dispatch.shape == (8, 2, 16) and int(dispatch.sum()) == 8
    _, _, dispatch, _ = topkgating(_logits(4, 2), 1, capacity_factor=1.0, min_capacity=8, drop_policy="position")
    assert dispatch.shape[-1] == 8
    with pytest.raises(ValueError, match="fewer than min_capacity=4"):
        top1gating(_logits(2, 2), 1.0, 4)


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_encode_and_decode_like_the_dense_masks(k):
    torch.manual_seed(k)
    logits, tokens = _logits(seed=k), torch.randn(16, 8)
    if k == 1:
        dense, sparse = (top1gating(logits, 1.0, 0, use_rts=False, sparse_routes=s) for s in (False, True))
    elif k == 2:
        dense, sparse = (top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=s)
                         for s in (False, True))
    else:
        dense, sparse = (topkgating(logits, k, 1.0, 0, sparse_routes=s) for s in (False, True))
    combine, dispatch = dense[1], dense[2]
    capacity, experts, indices, locations, gates = int(sparse[1]), sparse[2], sparse[3], sparse[4], sparse[5]
    assert indices.shape == (k, 16) and indices.dtype == torch.int32
    slots = _route_slots(indices, locations, experts, capacity)
    buffer = _sparse_encode(tokens, slots, experts, capacity)
    torch.testing.assert_close(buffer, torch.einsum("sec,sm->ecm", dispatch.float(), tokens))
    output = torch.randn_like(buffer)
    torch.testing.assert_close(_sparse_decode(output.view(-1, 8), slots, gates, 16),
                               torch.einsum("sec,ecm->sm", combine, output))


@pytest.mark.unit
def test_top2_leaves_the_callers_logits_alone():
    logits = _logits()
    before = logits.clone()
    top2gating(logits, 1.0, 0)
    assert torch.equal(logits, before)


@pytest.mark.unit
def test_dropless_without_a_group_issues_no_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no collective without an expert group")

    monkeypatch.setattr(sharded_moe.dist, "all_reduce", refuse)
    monkeypatch.setattr(sharded_moe.dist, "get_world_size", refuse)
    _, combine, _, counts = topkgating(_logits(), 2, 1.0, 0, drop_tokens=False)
    assert combine.shape[-1] == int(counts.max())


@distributed_test(world_size=2, timeout=60)
def test_dropless_capacity_is_the_largest_load_over_the_group():
    """Ranks with different token counts agree on one capacity: the group's largest expert load."""
    rank = comm.get_rank()
    logits = _logits(tokens=4 + 12 * rank, seed=rank)
    loads = []
    for gate in (lambda: top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False, ep_group=comm.get_world_group()),
                 lambda: top2gating(logits, 1.0, 0, drop_tokens=False, ep_group=comm.get_world_group()),
                 lambda: topkgating(logits, 3, 1.0, 0, drop_tokens=False, ep_group=comm.get_world_group())):
        _, combine, _, counts = gate()
        largest = counts.max().clone()
        comm.all_reduce(largest, op=comm.ReduceOp.MAX)
        # top-1 clamps the capacity to this rank's tokens (DeepSpeed's), the others do not
        expected = min(int(largest), logits.shape[0]) if len(loads) == 0 else int(largest)
        assert combine.shape[-1] == expected
        loads.append(expected)


@pytest.mark.unit
def test_noise_is_deepspeeds_under_the_same_seed():
    """DeepSpeed draws its Gumbel and jitter noise with `torch.distributions`' rsample (u in [tiny, 1 - eps) for
    Gumbel; low + rand * (high - low) for Uniform): the same seed must give the same values, bitwise."""
    cpu = torch.device("cpu")
    torch.manual_seed(3)
    ours = sharded_moe.gumbel_rsample((100, 80), cpu)
    torch.manual_seed(3)
    expected = torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((100, 80))
    assert torch.equal(ours, expected)

    x = torch.randn(50, 8)
    for epsilon in (1e-2, 0.3):
        torch.manual_seed(4)
        jittered = sharded_moe.multiplicative_jitter(x, cpu, epsilon=epsilon)
        torch.manual_seed(4)
        uniform = torch.distributions.uniform.Uniform(torch.tensor(1.0 - epsilon), torch.tensor(1.0 + epsilon))
        assert torch.equal(jittered, x * uniform.rsample(x.shape))
    assert sharded_moe.multiplicative_jitter(x, cpu, epsilon=0) is x

    logits = _logits(tokens=16, experts=4, seed=5)
    torch.manual_seed(6)
    ours_rts = top1gating(logits, 0.5, 1, use_rts=True, noisy_gate_policy="RSample")
    torch.manual_seed(6)
    gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(logits.shape)
    torch.manual_seed(6)
    again = top1gating(logits, 0.5, 1, use_rts=True, noisy_gate_policy="RSample")
    assert all(torch.equal(a, b) for a, b in zip(ours_rts, again))
    assert torch.equal(ours_rts[3], torch.bincount((logits + gumbel).argmax(dim=1), minlength=4))
