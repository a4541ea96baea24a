"""Sequence-parallel attention against one-process causal attention over the whole sequence.

Every rank holds its slice of the sequence ([batch, seq, heads, head_dim]); the output and the
gradients of q, k and v on each rank must equal the matching slice of the one-process result
within 1e-6, and the bytes each rank sends must equal the formulas of zerodist/sequence/layout.py,
forward and backward separately.
"""

import pytest
import torch
import torch.nn.functional as F

import zerodist.comm as comm
from zerodist.sequence import DistributedAttention, RingAttention, SequenceLayout, SequenceParallelError
from zerodist.sequence.layout import check_heads, ring_backward_bytes, ring_bytes, ulysses_bytes
from tests.harness import distributed_test

BATCH, SEQ, HEAD_DIM = 2, 16, 8


def local_causal(q, k, v, causal=True):
    """One-process causal attention over [batch, seq, heads, d], grouped k/v heads repeated."""
    repeat = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _full(heads, kv_heads, dtype):
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=generator, dtype=dtype)
    k, v = (torch.randn(BATCH, SEQ, kv_heads, HEAD_DIM, generator=generator, dtype=dtype) for _ in range(2))
    weights = torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=generator, dtype=dtype)
    return q, k, v, weights


def _check(attention, layout, heads, kv_heads, formula, dtype=torch.float32, causal=True):
    q, k, v, weights = _full(heads, kv_heads, dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = local_causal(*full, causal=causal)
    (reference * weights).sum().backward()
    rows = layout.token_indices(SEQ)
    mine = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
    with comm.trace() as forward:
        out = attention(*mine)
    with comm.trace() as backward:
        (out * weights[:, rows]).sum().backward()
    torch.testing.assert_close(out, reference[:, rows], atol=1e-6, rtol=0)
    for local, whole in zip(mine, full):
        torch.testing.assert_close(local.grad, whole.grad[:, rows], atol=1e-6, rtol=0)
    # Ulysses' all-to-alls, the ring's point-to-point sends; nothing else
    sent = lambda t: t.bus_bytes("all_to_all") + t.total_bytes("send")  # noqa: E731
    assert sent(forward) == pytest.approx(formula[0], abs=1e-6), forward.format_summary()
    assert sent(backward) == pytest.approx(formula[1], abs=1e-6), backward.format_summary()
    assert forward.count("all_gather") == backward.count("reduce_scatter") == 0


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@distributed_test(world_size=[2, 4], timeout=60)
def test_ulysses_matches_one_process(heads, kv_heads):
    group = comm.get_world_group()
    size = comm.get_world_size()
    attention = DistributedAttention(local_causal, group, scatter_idx=2, gather_idx=1)
    formula = ulysses_bytes(batch=BATCH, seq=SEQ, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, degree=size,
                            element_size=4)
    formula = (formula, formula)
    _check(attention, SequenceLayout(comm.get_rank(), size), heads, kv_heads, formula)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (2, 2), (2, 1)])
@distributed_test(world_size=[2, 4], timeout=60)
def test_ring_matches_one_process(heads, kv_heads):
    group = comm.get_world_group()
    size = comm.get_world_size()
    attention = RingAttention(group, causal=True)  # head-tail chunks
    # float64: the ring adds the softmax up in blocks, in another order than one-process attention;
    # in float32 the two differ by up to ~1.3e-6 on values of order 1 (a few ulps), in float64 by ~1e-15
    shape = dict(batch=BATCH, seq=SEQ, kv_heads=kv_heads, head_dim=HEAD_DIM, degree=size, element_size=8)
    formula = ring_bytes(**shape), ring_backward_bytes(**shape)
    _check(attention, attention.layout, heads, kv_heads, formula, torch.float64)


@distributed_test(world_size=2, timeout=60)
def test_ring_without_a_mask_matches_one_process():
    """Not causal: contiguous slices, every block whole."""
    attention = RingAttention(comm.get_world_group(), causal=False)
    assert not attention.layout.head_tail
    shape = dict(batch=BATCH, seq=SEQ, kv_heads=2, head_dim=HEAD_DIM, degree=2, element_size=8)
    formula = ring_bytes(**shape), ring_backward_bytes(**shape)
    _check(attention, attention.layout, 4, 2, formula, torch.float64, causal=False)


@distributed_test(world_size=4, timeout=60)
def test_ulysses_refuses_heads_the_degree_does_not_divide():
    attention = DistributedAttention(local_causal, comm.get_world_group(), scatter_idx=2, gather_idx=1)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(SequenceParallelError, match="not divisible by sequence_parallel_size=4.*ring"):
        attention(q, q, q)


@pytest.mark.unit
def test_layout_and_rules():
    assert SequenceLayout(0, 2).token_indices(8).tolist() == [0, 1, 2, 3]
    assert SequenceLayout(1, 2, head_tail=True).token_indices(8).tolist() == [2, 3, 4, 5]
    assert SequenceLayout(0, 2, head_tail=True).token_indices(8).tolist() == [0, 1, 6, 7]
    with pytest.raises(SequenceParallelError, match="sequence length 6 is not divisible by 2 ranks x 2 chunks"):
        SequenceLayout(0, 2, head_tail=True).token_indices(6)
    check_heads(4, 2, 4)  # kv heads replicated up to the degree
    with pytest.raises(SequenceParallelError, match="3 key/value heads"):
        check_heads(6, 3, 2)
    # the MHA formula of the literature: 4 e B N h (P-1)/P^2
    assert ulysses_bytes(batch=1, seq=64, heads=4, kv_heads=4, head_dim=8, degree=4, element_size=2) == \
        4 * 2 * 64 * 32 * 3 // 16


def _seq_first(attention):
    return lambda q, k, v: attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
@distributed_test(world_size=2, timeout=60)
def test_batch_dim_idx_gives_deepspeeds_layout(heads, kv_heads):
    """DistributedAttention(attn, group) with DeepSpeed's defaults (scatter 2, gather 0) called with
    batch_dim_idx: the layout comes from it, batch-first (0) and sequence-first (1), heads the degree
    does not divide included; output and gradients equal one process's (batch-first with
    batch_dim_idx=0 came out wrong: gather_idx 0 was taken as the sequence)."""
    rank, degree = comm.get_rank(), comm.get_world_size()
    q, k, v, weights = _full(heads, kv_heads, torch.float32)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = local_causal(*full)
    (reference * weights).sum().backward()
    rows = slice(rank * SEQ // degree, (rank + 1) * SEQ // degree)
    for batch_dim in (0, 1):
        layout = (lambda t: t) if batch_dim == 0 else (lambda t: t.transpose(0, 1))  # noqa: E731
        local = local_causal if batch_dim == 0 else _seq_first(local_causal)
        mine = [layout(t[:, rows]).contiguous().requires_grad_() for t in (q, k, v)]
        out = DistributedAttention(local, comm.get_world_group())(*mine, batch_dim)
        (out * layout(weights[:, rows])).sum().backward()
        torch.testing.assert_close(layout(out), reference[:, rows], atol=1e-6, rtol=0)
        for piece, whole in zip(mine, full):
            torch.testing.assert_close(layout(piece.grad), whole.grad[:, rows], atol=1e-6, rtol=0)
