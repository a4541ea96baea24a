"""DeepSpeed's 5-argument Ulysses exchange: `_SeqAllToAll.apply(group, x, scatter_idx, gather_idx,
batch_dim_idx[, ..., num_kv_heads])`, heads the degree does not divide included.

[Note: DeepSpeed's head exchange] DeepSpeed's form reads the layout from `batch_dim_idx`, not from
the two indices: a 4-D tensor is [batch, seq, heads, head_dim] when `batch_dim_idx` is 0 and
[seq, batch, heads, head_dim] when it is 1; `scatter_idx` >= 2 means "sequence slices to head
slices" (scatter the heads, gather the sequence in rank order) and `scatter_idx` < 2 the way back
(scatter the sequence evenly, gather every rank's heads in rank order). The heads are dealt by
DeepSpeed's rule (`deepspeed.module_inject.tp_shard.get_shard_size_list`; `shard_sizes` here): with H heads over P ranks the first H % P ranks take one more, and with
`num_kv_heads` given (grouped query attention) whole key/value groups are dealt.

The way back needs every rank's head count, which a rank cannot read off its own slice (DeepSpeed
0.19.6 kept the count of the last uneven exchange process-wide for it; 0.19.8 only inside one
autograd pair). Here each call first gathers every rank's shape over the group (one all-gather of
a few integers), which also checks them: a tensor the exchange cannot take is the same
`SequenceParallelError` on every rank, not a gloo abort. The backward exchanges the other way with
the sizes its forward saw, without that check. The exchange itself is one `all_to_all_single` of
the flattened pieces with their split sizes, so uneven pieces travel as they are.
"""

from __future__ import annotations

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.sequence.errors import SequenceParallelError

HEADS_DIM = 2
MAX_DIMS = 8  # the dimensions the shape gather carries


def shard_sizes(heads: int, degree: int, num_kv_heads: int | None = None) -> list[int]:
    """DeepSpeed's split of `heads` over `degree` ranks (its `tp_shard.get_shard_size_list` with a
    key/value head count): whole key/value groups dealt out, the first `kv % degree` ranks taking one
    more; `kv` is `heads` when not given."""
    kv = heads if num_kv_heads is None else num_kv_heads
    if kv < degree or heads % kv:
        raise SequenceParallelError(f"_SeqAllToAll: {heads} heads in {kv} key/value groups over {degree} sequence "
                                    "ranks: every rank needs a whole group at least (a degree of at most the "
                                    "key/value head count, which divides the head count)")
    return [heads * (kv // degree + (1 if rank < kv % degree else 0)) // kv for rank in range(degree)]


def _everyone_shapes(input: torch.Tensor, group: Group) -> list[list[int]]:
    """Every rank's shape (its first `MAX_DIMS` sizes); a rank with more dimensions makes every rank
    refuse, after the gather (refusing before it would leave the other ranks waiting in it)."""
    degree = comm.get_world_size(group)
    sizes = list(input.shape[:MAX_DIMS])
    mine = torch.tensor([input.dim(), *sizes, *([0] * (MAX_DIMS - len(sizes)))], dtype=torch.int64,
                        device=input.device)
    everyone = torch.empty(degree * mine.numel(), dtype=torch.int64, device=input.device)
    comm.all_gather(everyone, mine, group=group)
    rows = everyone.view(degree, -1).tolist()
    if any(row[0] > MAX_DIMS for row in rows):
        raise SequenceParallelError(f"_SeqAllToAll: the ranks brought tensors of {[row[0] for row in rows]} dimensions; "
                                    "DeepSpeed's exchange takes [batch, seq, heads, head_dim] or "
                                    "[seq, batch, heads, head_dim]")
    return [row[1:1 + row[0]] for row in rows]


def plan(input: torch.Tensor, group: Group, scatter_idx: int, batch_dim_idx: int,
         num_kv_heads: int | None) -> tuple[int, int, list[int], list[int]]:
    """(scatter dim, gather dim, scatter sizes, gather sizes) of DeepSpeed's exchange, after checking
    every rank's shape (a collective over `group`: every rank of it calls this)."""
    shapes = _everyone_shapes(input, group)  # first: every rank then refuses alike
    degree, rank = len(shapes), comm.get_rank(group)
    if batch_dim_idx not in (0, 1) or any(len(shape) != 4 for shape in shapes):
        raise SequenceParallelError(f"_SeqAllToAll(..., batch_dim_idx={batch_dim_idx}): DeepSpeed's exchange takes "
                                    "4-D tensors with batch_dim_idx 0 ([batch, seq, heads, head_dim]) or 1 ([seq, "
                                    f"batch, heads, head_dim]); the ranks brought shapes {shapes}")
    seq_dim = 1 - batch_dim_idx
    if scatter_idx >= HEADS_DIM:  # sequence slices -> head slices
        if any(shape != shapes[0] for shape in shapes):
            raise SequenceParallelError(f"_SeqAllToAll: the ranks of the sequence group bring different shapes "
                                        f"{shapes}; scattering the heads needs the same shape on every rank")
        sizes = shard_sizes(shapes[0][HEADS_DIM], degree, num_kv_heads)
        return HEADS_DIM, seq_dim, sizes, [shapes[0][seq_dim]] * degree
    others = [[size for dim, size in enumerate(shape) if dim != HEADS_DIM] for shape in shapes]
    if any(other != others[0] for other in others) or shapes[rank][seq_dim] % degree:
        raise SequenceParallelError(f"_SeqAllToAll: scattering the sequence (dimension {seq_dim}) over {degree} "
                                    f"ranks needs the same shape on every rank but the heads, and a sequence length "
                                    f"the degree divides; the ranks brought {shapes}")
    return seq_dim, HEADS_DIM, [shapes[rank][seq_dim] // degree] * degree, [shape[HEADS_DIM] for shape in shapes]


def exchange(input: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int, scatter_sizes: list[int],
             gather_sizes: list[int]) -> torch.Tensor:
    """Piece i of `input` along `scatter_dim` (sizes `scatter_sizes`) goes to rank i; what rank j sends
    holds `gather_sizes[j]` along `gather_dim`, and the pieces received are concatenated there in
    rank order."""
    rank = comm.get_rank(group)
    pieces = input.split(scatter_sizes, dim=scatter_dim)
    send = torch.cat([piece.contiguous().view(-1) for piece in pieces])
    shapes = []
    for size in gather_sizes:
        shape = list(input.shape)
        shape[scatter_dim], shape[gather_dim] = scatter_sizes[rank], size
        shapes.append(shape)
    counts = [int(torch.Size(shape).numel()) for shape in shapes]
    received = torch.empty(sum(counts), dtype=input.dtype, device=input.device)
    comm.all_to_all_single(received, send, output_split_sizes=counts,
                           input_split_sizes=[piece.numel() for piece in pieces], group=group)
    return torch.cat([flat.view(shape) for flat, shape in zip(received.split(counts), shapes)], dim=gather_dim)
