"""Ring attention: every rank keeps its own queries and meets every rank's keys and values one
block at a time, merging the partial softmaxes by their log-sum-exp. It needs no head to divide
the degree, so it runs where Ulysses cannot (P > heads, heads not divisible).

Softmax over the whole sequence from blocks: for a query row, block b gives its attention output
o_b over the block's keys and lse_b = log sum_j exp(s_j). Two blocks merge exactly as
    lse = logaddexp(lse_a, lse_b),  o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse),
so the merged result is softmax(QK^T) V over the union, whatever the order of the blocks.

Traffic: [Note: ring traffic]. Causal masks use the head-tail layout (zerodist/sequence/layout.py,
[Note: head-tail balance]): a block whose key chunk comes after the query chunk is skipped, the
diagonal block is masked, every other block is whole, so no row of a computed block is empty.

[Note: ring traffic] Each rank's K and V slice must reach the other P-1 ranks in forward and
their gradients come back in backward. A rotation sends it one hop per step over P-1 steps;
zerodist.comm has no point-to-point send, so the slices travel by one all-gather in forward and
one reduce-scatter of dK, dV in backward (the pattern of Megatron's context parallel and of
torch's `context_parallel` "allgather" rotation). The bytes each rank sends are the rotation's:
2 e B N H_kv d (P-1)/P in forward and the same in backward (`layout.ring_bytes`); the autograd
graph keeps the blocks, so the backward rotates nothing again. The price is holding all P
slices of K and V at once (B N H_kv d elements each), which a rotation would hold two at a time.
"""

from __future__ import annotations

from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.sequence.layout import SequenceLayout


class _GatherSlices(torch.autograd.Function):
    """Every rank's `local` stacked along a new first dimension; backward reduce-scatters the
    gradients back to their owners, summed over the ranks that used them."""

    @staticmethod
    def forward(ctx: Any, group: Group, local: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        size = comm.get_world_size(group)
        gathered = torch.empty((size, *local.shape), dtype=local.dtype, device=local.device)
        comm.all_gather(gathered.view(-1), local.contiguous().view(-1), group=group)
        return gathered

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        grad = grads[0].contiguous()
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter(mine.view(-1), grad.view(-1), group=ctx.group)
        return None, mine


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query chunk over one key chunk ([..., len, heads, d]): the output and the
    log-sum-exp of each row ([..., len, heads])."""
    scores = torch.einsum("...qhd,...khd->...hqk", query, key) * scale
    if diagonal:
        length = scores.shape[-1]
        later = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    return torch.einsum("...hqk,...khd->...qhd", weights, value), lse.transpose(-1, -2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, layout: SequenceLayout,
                   *, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V over the whole sequence for this rank's queries.

    q: [..., S_local, H, d], k and v: [..., S_local, H_kv, d] (H_kv dividing H: query head i uses
    key head i // (H / H_kv)); each rank holds the tokens `layout` gives it (head-tail chunks under
    a causal mask, for balance). Returns [..., S_local, H, d]."""
    heads, kv_heads, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot be grouped over {kv_heads} key/value heads")
    scale = head_dim ** -0.5 if scale is None else scale
    chunk = layout.check_length(query.shape[-3] * layout.size)
    gathered = _GatherSlices.apply(group, torch.stack([key, value]))  # [P, 2, ..., S_local, H_kv, d]
    blocks = {}  # chunk id -> (key, value) of that chunk, heads repeated to the query heads
    for rank in range(layout.size):
        for index, chunk_id in enumerate(layout.chunk_ids(rank)):
            piece = gathered[rank].narrow(-3, index * chunk, chunk).repeat_interleave(heads // kv_heads, dim=-2)
            blocks[chunk_id] = (piece[0], piece[1])
    outputs = []
    for index, query_id in enumerate(layout.chunk_ids()):
        q = query.narrow(-3, index * chunk, chunk)
        out = lse = None
        for key_id in sorted(blocks):
            if causal and key_id > query_id:
                continue  # wholly in the future of every query of this chunk
            block_out, block_lse = _block(q, *blocks[key_id], scale, diagonal=causal and key_id == query_id)
            if out is None or lse is None:
                out, lse = block_out, block_lse
            else:
                out, lse = _merge(out, lse, block_out, block_lse)
        assert out is not None
        outputs.append(out)
    return torch.cat(outputs, dim=-3).to(query.dtype)


class RingAttention(torch.nn.Module):
    """Ring attention as a module over [batch, seq, heads, head_dim] (any layout with
    `seq_dim`, `heads_dim`): each rank holds the tokens of its layout, head-tail chunks when
    `causal` (the load balance) unless `head_tail=False`."""

    def __init__(self, sequence_process_group: Group, *, causal: bool = True, head_tail: bool | None = None,
                 seq_dim: int = 1, heads_dim: int = 2) -> None:
        super().__init__()
        self.group, self.causal = sequence_process_group, causal
        self.head_tail = causal if head_tail is None else head_tail
        self.seq_dim, self.heads_dim = seq_dim, heads_dim

    @property
    def layout(self) -> SequenceLayout:
        return SequenceLayout(comm.get_rank(self.group), comm.get_world_size(self.group), self.head_tail)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
        dims = (self.seq_dim % query.dim(), self.heads_dim % query.dim())
        q, k, v = (t.movedim(dims, (-3, -2)) for t in (query, key, value))
        out = ring_attention(q, k, v, self.group, self.layout, causal=self.causal, scale=scale)
        return out.movedim((-3, -2), dims)
