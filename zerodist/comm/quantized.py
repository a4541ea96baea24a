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
    quantized_all_gather_start(...same arguments...) -> CommHandle    # async: wait() returns the result
    quantized_reduce_scatter_start(...same arguments...) -> CommHandle
    reduce_scatter_shard_index(group: Group = None, inter_group: Group = None) -> int
    measure_quantization_error() -> context manager yielding a QuantErrorMeter
    all_gather_nbytes(shard_numel, group_size, bits, block) -> int
    reduce_scatter_nbytes(numel, group_size, bits, block, inter_size=1) -> tuple[int, int]

The plain forms are synchronous and return the result tensor (`out`, if given: contiguous,
of the result's numel; any float dtype); their `_start` forms issue the (first)
collective asynchronously and return a `CommHandle` whose `wait()` finishes the work
(dequantize, sum; for hierarchical qgZ also the second hop, issued synchronously inside
`wait()`, so waits must come in the same order on every rank, as ZeRO's bucket order ensures)
and returns the result. They go through zerodist's `all_gather` / `all_to_all_single`, so the
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

[Note: quantization error meter] Inside `measure_quantization_error()`, every quantization these
collectives do on this rank is measured against what it quantized: the chunks it sends (qwZ: its
shard; qgZ: its chunks, and at hop 2 the fp32 partial sums it re-quantizes), each round-tripped
through dequantize. The meter sums squared errors and squared norms per op ("all_gather",
"reduce_scatter"), so `meter.error(op)` is this rank's relative L2 quantization error over all it
sent, and its max absolute error. It is this rank's contribution, measured without any extra
collective; the error of a reduced result against the exact sum (which would need the exact
collective too) is bounded by the sum of the senders' contributions. With no meter active the
cost is one truthiness test per collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerodist.comm import collectives, tracer
from zerodist.comm.collectives import CommHandle, Group
from zerodist.comm.init import ensure_initialized
from zerodist.comm.quantize import (
    DEFAULT_BLOCK,
    QuantError,
    check_format,
    dequantize_rows,
    quantize_rows,
    quantized_nbytes,
    rows_from_wire,
    rows_to_wire,
)

# qgZ's all-to-alls are traced under this label (`tracer.labelled`), so a report that counts all-to-all
# bytes for something else (Ulysses' sequence <-> heads exchange, zerodist/train/loop.py) leaves them out.
QGZ_LABEL = "qgZ"

__all__ = [
    "QuantErrorMeter", "all_gather_nbytes", "measure_quantization_error", "quantized_all_gather",
    "quantized_all_gather_start", "quantized_reduce_scatter", "quantized_reduce_scatter_start",
    "reduce_scatter_nbytes", "reduce_scatter_shard_index",
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
    intra = _member_rank(group, "group")
    if inter_group is None:
        return intra
    return _member_rank(inter_group, "inter_group") * dist.get_world_size(group) + intra


# ---------------------------------------------------------------- the error meter

@dataclasses.dataclass
class _ErrorTotals:
    squared_error: float = 0.0
    squared_norm: float = 0.0
    max_abs: float = 0.0
    numel: int = 0


class QuantErrorMeter:
    """This rank's quantization error in the quantized collectives of a block ([Note: quantization
    error meter])."""

    def __init__(self) -> None:
        self._totals: dict[str, _ErrorTotals] = {}

    def add(self, op: str, exact: torch.Tensor, approx: torch.Tensor) -> None:
        diff = (exact.to(torch.float64) - approx.to(torch.float64)).reshape(-1)
        totals = self._totals.setdefault(op, _ErrorTotals())
        totals.squared_error += float(diff.dot(diff))
        norm = exact.to(torch.float64).reshape(-1)
        totals.squared_norm += float(norm.dot(norm))
        totals.max_abs = max(totals.max_abs, float(diff.abs().max()) if diff.numel() else 0.0)
        totals.numel += diff.numel()

    def numel(self, op: str | None = None) -> int:
        """Elements quantized (by `op`, or by all)."""
        return sum(t.numel for name, t in self._totals.items() if op is None or name == op)

    def error(self, op: str | None = None) -> QuantError:
        """Max abs and relative L2 error over everything quantized (by `op`: "all_gather" or
        "reduce_scatter"; None: both)."""
        chosen = [t for name, t in self._totals.items() if op is None or name == op]
        squared_error = sum(t.squared_error for t in chosen)
        squared_norm = sum(t.squared_norm for t in chosen)
        max_abs = max((t.max_abs for t in chosen), default=0.0)
        if squared_norm > 0:
            return QuantError(max_abs, math.sqrt(squared_error / squared_norm))
        return QuantError(max_abs, 0.0 if squared_error == 0 else math.inf)


_meters: list[QuantErrorMeter] = []


@contextlib.contextmanager
def measure_quantization_error() -> Iterator[QuantErrorMeter]:
    """Measure this rank's quantization error in the quantized collectives issued in the block."""
    meter = QuantErrorMeter()
    _meters.append(meter)
    try:
        yield meter
    finally:
        _meters.remove(meter)


def _quantize_to_wire(op: str, rows: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Quantize each row of `rows` on its own, as (rows, wire bytes) uint8; measured if a meter is on."""
    payload, scales = quantize_rows(rows, bits, block)
    if _meters:
        exact = rows.detach().to(torch.float32)
        approx = dequantize_rows(payload, scales, bits, rows.shape[1])
        for meter in _meters:
            meter.add(op, exact, approx)
    return rows_to_wire(payload, scales)


# ---------------------------------------------------------------- the collectives

class _Pending(CommHandle):
    """A quantized collective in flight: `wait()` waits for its exchange, then runs `finish`."""

    __slots__ = ("_inner", "_finish", "_keep")

    def __init__(self, tensor: torch.Tensor, inner: CommHandle, finish: Callable[[], None], keep: Any):
        super().__init__(tensor)
        self._inner: CommHandle | None = inner
        self._finish = finish
        self._keep = keep  # buffers the backend reads or writes until the exchange completes

    def wait(self) -> torch.Tensor | None:
        if self._inner is not None:
            self._inner.wait()
            self._inner = None
            self._finish()
            self._keep = None
        return self.tensor

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()


def _member_rank(group: Group, name: str) -> int:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of the {name} it was given; "
                         "call the quantized collectives only on the ranks of their groups")
    return rank


def _check_input(op: str, tensor: torch.Tensor, out: torch.Tensor | None, bits: int, block: int) -> None:
    check_format(bits, block)
    if not tensor.is_floating_point():
        raise TypeError(f"{op}: the input must be floating point, got {tensor.dtype}")
    if out is not None and not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous")


def quantized_all_gather_start(shard: torch.Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                               *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> CommHandle:
    """`quantized_all_gather`, issued asynchronously: `wait()` on the handle returns the result."""
    _check_input("quantized_all_gather", shard, out, bits, block)
    ensure_initialized()
    _member_rank(group, "group")
    size, n = dist.get_world_size(group), shard.numel()
    if out is not None and out.numel() != size * n:
        raise ValueError(f"quantized_all_gather: out has {out.numel()} elements but must have group size ({size}) "
                         f"x shard ({n}) = {size * n}")
    dtype = dtype or (out.dtype if out is not None else shard.dtype)
    result = out if out is not None else torch.empty(size * n, dtype=dtype, device=shard.device)
    wire = _quantize_to_wire("all_gather", shard.detach().reshape(1, n), bits, block).reshape(-1)
    gathered = torch.empty(size * wire.numel(), dtype=torch.uint8, device=shard.device)
    inner = collectives.all_gather(gathered, wire, group=group, async_op=True)

    def finish() -> None:
        payload, scales = rows_from_wire(gathered.reshape(size, -1), bits, block, n)
        result.view(-1).copy_(dequantize_rows(payload, scales, bits, n, torch.float32).reshape(-1))

    return _Pending(result, inner, finish, (wire, gathered))


def quantized_all_gather(shard: torch.Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                         *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """qwZ ([Note: qwZ]): every rank's `shard` (the same numel on every rank), block-quantized to
    `bits`, all-gathered and dequantized; returns the flat concatenation in group-rank order
    (written into `out` if given: group size x shard.numel() elements)."""
    result = quantized_all_gather_start(shard, group, bits, block, out=out, dtype=dtype).wait()
    assert result is not None
    return result


def quantized_reduce_scatter_start(flat: torch.Tensor, group: Group = None, bits: int = 8,
                                   block: int = DEFAULT_BLOCK, inter_group: Group = None, *,
                                   out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> CommHandle:
    """`quantized_reduce_scatter`, its first hop issued asynchronously: `wait()` on the handle
    finishes it (and runs the inter hop, synchronously) and returns the result."""
    _check_input("quantized_reduce_scatter", flat, out, bits, block)
    ensure_initialized()
    reduce_scatter_shard_index(group, inter_group)  # this rank must be in both groups
    intra = dist.get_world_size(group)
    inter = 1 if inter_group is None else dist.get_world_size(inter_group)
    total = intra * inter
    if flat.numel() % total:
        raise ValueError(
            f"quantized_reduce_scatter: flat has {flat.numel()} elements, not a multiple of the {total} ranks it is "
            f"scattered over ({intra} in group x {inter} in inter_group); pad it to a multiple of {total}")
    n = flat.numel() // total
    if out is not None and out.numel() != n:
        raise ValueError(f"quantized_reduce_scatter: out has {out.numel()} elements but the shard has {n}")
    dtype = dtype or (out.dtype if out is not None else flat.dtype)
    result = out if out is not None else torch.empty(n, dtype=dtype, device=flat.device)
    # (node m, intra j) -> row block j holds the chunks of destinations m * intra + j, in node order
    chunks = flat.detach().reshape(inter, intra, n).transpose(0, 1).reshape(total, n)
    wire = _quantize_to_wire("reduce_scatter", chunks, bits, block).reshape(-1)
    received = torch.empty_like(wire)
    with tracer.labelled(QGZ_LABEL):
        inner = collectives.all_to_all_single(received, wire, group=group, async_op=True)

    def finish() -> None:
        partial = _sum_received(received, total, intra, n, bits, block)  # (inter, n): hop 1's sums
        if inter_group is not None:
            hop2 = _quantize_to_wire("reduce_scatter", partial, bits, block).reshape(-1)
            back = torch.empty_like(hop2)
            with tracer.labelled(QGZ_LABEL):
                collectives.all_to_all_single(back, hop2, group=inter_group)
            partial = _sum_received(back, inter, inter, n, bits, block)
        result.view(-1).copy_(partial.reshape(-1))

    return _Pending(result, inner, finish, (wire, received))


def quantized_reduce_scatter(flat: torch.Tensor, group: Group = None, bits: int = 8, block: int = DEFAULT_BLOCK,
                             inter_group: Group = None, *, out: torch.Tensor | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """qgZ ([Note: qgZ shard contract]): this rank's shard of the sum of every rank's `flat`,
    exchanged block-quantized to `bits` by all-to-all (intra `group`, then `inter_group` if
    given), summed in fp32; in `dtype` (default flat's), written into `out` if given."""
    result = quantized_reduce_scatter_start(flat, group, bits, block, inter_group, out=out, dtype=dtype).wait()
    assert result is not None
    return result


def _sum_received(received: torch.Tensor, rows: int, senders: int, n: int, bits: int, block: int) -> torch.Tensor:
    """`rows` received wire chunks of `n` elements, `rows / senders` from each sender in group-rank
    order: dequantized and summed over the senders in fp32, in that order. One sender's chunks are
    dequantized at a time, so the fp32 temporaries are two shards' worth, not the whole bucket's."""
    payload, scales = rows_from_wire(received.reshape(rows, -1), bits, block, n)
    per_sender = rows // senders
    total = dequantize_rows(payload[:per_sender], scales[:per_sender], bits, n, torch.float32)
    for sender in range(1, senders):
        lo = sender * per_sender
        total.add_(dequantize_rows(payload[lo:lo + per_sender], scales[lo:lo + per_sender], bits, n, torch.float32))
    return total
