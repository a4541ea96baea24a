"""DeepSpeed's `DistributedAttention(..., num_kv_heads=...)` and `forward(q, k, v, batch_dim_idx,
rotary_pos_emb, *args)` (DeepSpeed 0.19.8's meaning), against one process over the whole sequence.

- `num_kv_heads` (grouped-query attention): the heads are dealt by key/value group, so each query
  head lands on the rank that holds its key/value head: 6 query heads in 3 groups over 2 ranks go
  4 + 2, also when the key comes already expanded to 6 heads (whose own count would split 3 + 3);
- `rotary_pos_emb` = (cos, sin), permuted (1, 0, 2, 3) and applied to q and k after the exchange,
  i.e. over the whole sequence; arguments after it reach the local attention.
Outputs and the gradients of q, k, v equal the one-process ones within 1e-6.
"""

import pytest
import torch
import torch.nn.functional as F

import zerodist.comm as comm
from zerodist.sequence import DistributedAttention
from tests.harness import distributed_test

BATCH, SEQ, HEAD_DIM = 2, 8, 8


def grouped_attention(q, k, v, causal=True, seen=None):
    """One-process attention over [batch, seq, heads, d]; key/value head j serves query heads
    j * g ... (j + 1) * g - 1 (g = query heads / key/value heads)."""
    if seen is not None:
        seen.append(q.shape[2])
    repeat = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _rotate(t, cos, sin):
    """The rotary embedding written out: the first cos.shape[-1] features rotated in halves."""
    width = cos.shape[-1]
    x1, x2, rest = t[..., : width // 2], t[..., width // 2: width], t[..., width:]
    return torch.cat([x1 * cos[..., : width // 2] - x2 * sin[..., : width // 2],
                      x2 * cos[..., width // 2:] + x1 * sin[..., width // 2:], rest], dim=-1)


def _tensors(heads, kv_heads):
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, SEQ, kv_heads, HEAD_DIM, generator=generator) for _ in range(2))
    weights = torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=generator)
    return q, k, v, weights


def _rotary(width):
    """DeepSpeed's rotary tensors, [seq, 1, 1, width] each: (1, 0, 2, 3) makes them [1, seq, 1, width]."""
    inverse = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), inverse)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def _compare(attention_call, reference_call, q, k, v, weights, batch_dim):
    """Run both: the reference on the whole tensors, the attention on this rank's slice of the
    sequence in the layout of `batch_dim`; the output and every gradient must agree."""
    rank, degree = comm.get_rank(), comm.get_world_size()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = reference_call(*full)
    (reference * weights).sum().backward()
    rows = slice(rank * SEQ // degree, (rank + 1) * SEQ // degree)
    layout = (lambda t: t) if batch_dim == 0 else (lambda t: t.transpose(0, 1))  # noqa: E731
    mine = [layout(t[:, rows]).contiguous().requires_grad_() for t in (q, k, v)]
    out = attention_call(*mine)
    (out * layout(weights[:, rows])).sum().backward()
    torch.testing.assert_close(layout(out), reference[:, rows], atol=1e-6, rtol=0)
    for piece, whole in zip(mine, full):
        torch.testing.assert_close(layout(piece.grad), whole.grad[:, rows], atol=1e-6, rtol=0)


def _local(batch_dim, seen=None):
    if batch_dim == 0:
        return lambda q, k, v, causal=True: grouped_attention(q, k, v, causal, seen)
    return lambda q, k, v, causal=True: grouped_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal,
                                                          seen).transpose(0, 1)


@pytest.mark.parametrize("expanded", [False, True], ids=["kv-heads", "expanded-key"])
@distributed_test(world_size=2, timeout=60)
def test_num_kv_heads_deals_heads_by_key_value_group(expanded):
    q, k, v, weights = _tensors(heads=6, kv_heads=3)
    if expanded:  # the key/value heads repeated to the query's count before the call
        k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))
    for batch_dim in (0, 1):
        seen = []
        attention = DistributedAttention(_local(batch_dim, seen), comm.get_world_group(), num_kv_heads=3)
        _compare(lambda *qkv: attention(*qkv, batch_dim), grouped_attention, q, k, v, weights, batch_dim)
        # 3 groups over 2 ranks: 2 + 1 groups, so 4 + 2 query heads (the key's own 6 would give 3 + 3)
        assert seen == [[4, 2][comm.get_rank()]]


@distributed_test(world_size=2, timeout=60)
def test_without_num_kv_heads_the_keys_count_deals_the_heads():
    q, k, v, weights = _tensors(heads=6, kv_heads=6)
    seen = []
    attention = DistributedAttention(_local(0, seen), comm.get_world_group())
    _compare(lambda *qkv: attention(*qkv, 0), grouped_attention, q, k, v, weights, 0)
    assert seen == [3]


@pytest.mark.parametrize("width", [HEAD_DIM, HEAD_DIM // 2], ids=["whole-head", "partial"])
@distributed_test(world_size=2, timeout=60)
def test_rotary_pos_emb_and_extra_args_reach_the_local_attention(width):
    """rotary_pos_emb applied over the whole sequence after the exchange; the positional argument
    after it (causal=False) reaches the local attention."""
    cos, sin = _rotary(width)
    q, k, v, weights = _tensors(heads=4, kv_heads=2)
    positions = (cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3))  # [1, seq, 1, width]

    def reference(q, k, v):
        return grouped_attention(_rotate(q, *positions), _rotate(k, *positions), v, causal=False)

    for batch_dim in (0, 1):
        # sequence-first: DeepSpeed's (1, 0, 2, 3) must give [seq, 1, 1, width], so pass [1, seq, 1, width]
        pair = (cos, sin) if batch_dim == 0 else positions
        attention = DistributedAttention(_local(batch_dim), comm.get_world_group())
        _compare(lambda *qkv: attention(*qkv, batch_dim, pair, False), reference, q, k, v, weights, batch_dim)


@pytest.mark.unit
def test_one_process_applies_the_rotary_embedding_too():
    cos, sin = _rotary(HEAD_DIM)
    q, k, v, _ = _tensors(heads=4, kv_heads=4)
    positions = (cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3))
    out = DistributedAttention(grouped_attention, None)(q, k, v, 0, (cos, sin), False)
    expected = grouped_attention(_rotate(q, *positions), _rotate(k, *positions), v, causal=False)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


@pytest.mark.unit
def test_bad_arguments_are_named():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match="rotary_pos_emb is DeepSpeed's .cos, sin. pair.*rotary_pos_emb=None first"):
        DistributedAttention(grouped_attention, None)(q, q, q, 0, 0.1)
    with pytest.raises(ValueError, match="num_kv_heads is the number of key/value heads"):
        DistributedAttention(grouped_attention, None, num_kv_heads=0)
