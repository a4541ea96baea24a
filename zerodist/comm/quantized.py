"""Quantized collectives: ZeRO++'s qwZ (quantized weight all-gather) and qgZ (quantized gradient
reduce-scatter by all-to-all, optionally hierarchical), over torch.distributed groups.

    full = quantized_all_gather(shard, group, bits=8, block=256)            # qwZ
    mine = quantized_reduce_scatter(flat, group, bits=4, block=256)         # qgZ, one hop
    mine = quantized_reduce_scatter(flat, intra, bits=4, inter_group=inter) # qgZ, intra then inter

Signatures (stable; later additions are keyword-only):

    quantized_all_gather(shard: Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                         *, out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor
    quantized_reduce_scatter(flat: Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                             inter_group: Group = None, *, out: Tensor | None = None,
                             dtype: torch.dtype | None = None) -> Tensor
    reduce_scatter_shard_index(group: Group = None, inter_group: Group = None) -> int
    all_gather_nbytes(shard_numel, group_size, bits, block) -> int
    reduce_scatter_nbytes(numel, group_size, bits, block, inter_size=1) -> tuple[int, int]

Both are synchronous and return the result tensor (wrap it in `CommHandle(tensor)` where a
handle is expected). They go through zerodist's `all_gather` / `all_to_all_single`, so the
tracer records them, and every byte they move is a quantized chunk's wire buffer
(`Quantized.to_wire()`: payload, then fp32 scales), recorded as uint8.

[Note: qwZ] `quantized_all_gather`: every rank quantizes its whole `shard` (one block-quantized
chunk of `shard.numel()` elements), the wire buffers are all-gathered, and every rank dequantizes
all of them, its own included, so every rank holds the same bits (the owner does not keep its
exact shard: ZeRO-3 needs every rank to compute with the same weights). The result is the
concatenation in group-rank order, as `all_gather`'s, in `dtype` (default: the shard's).

[Note: qgZ shard contract] `quantized_reduce_scatter(flat, group)` returns, on the rank of index
r in `group`, the sum over the group's ranks of `flat[r * S:(r + 1) * S]`, S = flat.numel() / group
size: the slice `reduce_scatter` gives (and ZeRO's buckets own: `BucketSpan.shard_offset(rank)` in
zero/layout.py is rank * shard_numel over the bucket's group). Each rank splits `flat` into one
chunk per destination, quantizes each chunk on its own (blocks never straddle two chunks),
exchanges them by one all-to-all, dequantizes what it received and sums it in fp32 in
group-rank order (so the sum is the same bits wherever it is computed), then casts to `dtype`
(default: flat's). It is the sum, not the mean: the caller divides, as after `reduce_scatter`.

Hierarchical (`inter_group` given), DeepSpeed's qgZ (`all_to_all_quant_reduce`): `group` is the
intra-node group (L ranks, index j) and `inter_group` the ranks of the same intra index on the
other nodes (M ranks, index n); the full reduction spans L * M ranks and this rank's shard index
is `n * L + j` (`reduce_scatter_shard_index`): with node-contiguous ranks (node n holds global
ranks n*L .. n*L+L-1, as `Topology` numbers them) and a reduce group of all of them, that is the
rank in that group, the slice ZeRO owns. Chunk d = n*L + j of `flat` is the one for that rank.
Hop 1 (intra): chunks are quantized and sent to intra peer j, all chunks d with d % L == j,
in node order; each rank dequantizes, sums the L received partial vectors in fp32 in intra-rank
order, and re-quantizes the M partial sums. Hop 2 (inter): partial sum n goes to node n; each rank
dequantizes the M partial sums it receives and sums them in fp32 in node order. Only hop 2 crosses
nodes, with 1/L of the data, quantized.

Bytes, under the tracer's size convention ([Note: bandwidth conventions] in tracer.py: the
gathered output for all_gather, the input for all_to_all), with
q(n) = quantize.quantized_nbytes(n, bits, block) = ceil(n / block) * (block * bits / 8 + 4):
- all-gather of a shard of S elements over W ranks: W * q(S);
- reduce-scatter of N elements over W = L * M ranks, S = N / W: hop 1 W * q(S) (over `group`),
  hop 2 M * q(S) (over `inter_group`; absent when it is None).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerodist.comm import collectives
from zerodist.comm.collectives import Group
from zerodist.comm.init import ensure_initialized
from zerodist.comm.quantize import (
    DEFAULT_BLOCK,
    check_format,
    dequantize_rows,
    quantize_rows,
    quantized_nbytes,
    rows_from_wire,
    rows_to_wire,
)

__all__ = [
    "all_gather_nbytes", "quantized_all_gather", "quantized_reduce_scatter", "reduce_scatter_nbytes",
    "reduce_scatter_shard_index",
]


def all_gather_nbytes(shard_numel: int, group_size: int, bits: int = 8, block: int = DEFAULT_BLOCK) -> int:
    """Bytes the tracer records for `quantized_all_gather` of a `shard_numel` shard over `group_size` ranks."""
    return group_size * quantized_nbytes(shard_numel, bits, block)


def reduce_scatter_nbytes(numel: int, group_size: int, bits: int = 8, block: int = DEFAULT_BLOCK,
                          inter_size: int = 1) -> tuple[int, int]:
    """Bytes the tracer records for `quantized_reduce_scatter` of `numel` elements: (hop 1 over
    `group`, hop 2 over `inter_group`; 0 without one). `group_size` is the intra group's size."""
    total = group_size * inter_size
    if numel % total:
        raise ValueError(f"{numel} elements do not split into {total} equal shards")
    chunk = quantized_nbytes(numel // total, bits, block)
    return total * chunk, (inter_size * chunk if inter_size > 1 else 0)


def reduce_scatter_shard_index(group: Group = None, inter_group: Group = None) -> int:
    """Which shard `quantized_reduce_scatter(flat, group, inter_group=inter_group)` returns on this
    rank ([Note: qgZ shard contract]): rank(inter_group) * size(group) + rank(group)."""
    ensure_initialized()
    intra = dist.get_rank(group)
    if inter_group is None:
        return intra
    return dist.get_rank(inter_group) * dist.get_world_size(group) + intra


def quantized_all_gather(shard: torch.Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                         *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """qwZ ([Note: qwZ]): every rank's `shard` (the same numel on every rank), block-quantized to
    `bits`, all-gathered and dequantized; returns the flat concatenation in group-rank order
    (written into `out` if given: group size x shard.numel() elements)."""
    check_format(bits, block)
    if not shard.is_floating_point():
        raise TypeError(f"quantized_all_gather: shard must be floating point, got {shard.dtype}")
    ensure_initialized()
    size, n = dist.get_world_size(group), shard.numel()
    dtype = dtype or (out.dtype if out is not None else shard.dtype)
    if out is not None and out.numel() != size * n:
        raise ValueError(f"quantized_all_gather: out has {out.numel()} elements but must have group size ({size}) "
                         f"x shard ({n}) = {size * n}")
    payload, scales = quantize_rows(shard.detach().reshape(1, n), bits, block)
    wire = rows_to_wire(payload, scales).reshape(-1)
    gathered = torch.empty(size * wire.numel(), dtype=torch.uint8, device=shard.device)
    collectives.all_gather(gathered, wire, group=group)
    payload, scales = rows_from_wire(gathered.reshape(size, -1), bits, block, n)
    values = dequantize_rows(payload, scales, bits, n, dtype).reshape(-1)
    if out is None:
        return values
    out.view(-1).copy_(values)
    return out


def quantized_reduce_scatter(flat: torch.Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                             inter_group: Group = None, *, out: torch.Tensor | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """qgZ ([Note: qgZ shard contract]): this rank's shard of the sum of every rank's `flat`,
    exchanged block-quantized to `bits` by all-to-all (intra `group`, then `inter_group` if
    given), summed in fp32; in `dtype` (default flat's), written into `out` if given."""
    check_format(bits, block)
    if not flat.is_floating_point():
        raise TypeError(f"quantized_reduce_scatter: flat must be floating point, got {flat.dtype}")
    ensure_initialized()
    intra = dist.get_world_size(group)
    inter = 1 if inter_group is None else dist.get_world_size(inter_group)
    total = intra * inter
    if flat.numel() % total:
        raise ValueError(
            f"quantized_reduce_scatter: flat has {flat.numel()} elements, not a multiple of the {total} ranks it is "
            f"scattered over ({intra} in group x {inter} in inter_group); pad it to a multiple of {total}")
    shard_numel = flat.numel() // total
    if out is not None and out.numel() != shard_numel:
        raise ValueError(f"quantized_reduce_scatter: out has {out.numel()} elements but the shard has {shard_numel}")
    dtype = dtype or (out.dtype if out is not None else flat.dtype)
    # (node n, intra j) -> row j holds the chunks of destinations n * intra + j, in node order
    chunks = flat.detach().reshape(inter, intra, shard_numel).transpose(0, 1).reshape(total, shard_numel)
    partial = _exchange_and_sum(chunks, group, intra, bits, block)  # (inter, shard_numel): hop 1's sums
    if inter_group is not None:
        partial = _exchange_and_sum(partial, inter_group, inter, bits, block)
    result = partial.reshape(-1)
    if out is None:
        return result.to(dtype)
    out.view(-1).copy_(result)
    return out


def _exchange_and_sum(chunks: torch.Tensor, group: Group, size: int, bits: int, block: int) -> torch.Tensor:
    """One qgZ hop: `chunks` (size * k, n) fp rows, rows [i*k, (i+1)*k) for peer i, quantized and
    sent by all-to-all; returns the fp32 sum over peers, in group-rank order, of the (k, n) received."""
    n = chunks.shape[1]
    wire = rows_to_wire(*quantize_rows(chunks, bits, block)).reshape(-1)
    received = torch.empty_like(wire)
    collectives.all_to_all_single(received, wire, group=group)
    payload, scales = rows_from_wire(received.reshape(chunks.shape[0], -1), bits, block, n)
    values = dequantize_rows(payload, scales, bits, n, torch.float32).reshape(size, -1, n)
    total = values[0].clone()
    for peer in range(1, size):
        total.add_(values[peer])
    return total
