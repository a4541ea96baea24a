"""The conjugate operators of tensor parallelism, as autograd functions with explicit backwards.

Each operator is a pair (forward, backward) where one is a collective over the tensor axis and
the other is its adjoint (Megatron-LM's `mappings.py`):

| operator                    | forward                            | backward                          |
| --------------------------- | ---------------------------------- | --------------------------------- |
| `copy_to_tensor_region` (f) | identity                           | all-reduce                        |
| `reduce_from_tensor_region` (g) | all-reduce                     | identity                          |
| `gather_from_tensor_region` | all-gather along the last dim      | keep this rank's slice            |
| `scatter_to_tensor_region`  | keep this rank's slice (last dim)  | all-gather along the last dim     |
| `gather_from_sequence_region` | all-gather along the sequence dim | reduce-scatter along it          |
| `reduce_scatter_to_sequence_region` | reduce-scatter along the sequence dim | all-gather along it     |
| `scatter_to_sequence_region` | keep this rank's sequence slice   | all-gather along it               |

Every collective goes through `zerodist.comm` (so it initialises the world on first use, is
traced and guarded), over the `TensorRegion` built from a `Topology`: no module globals. A
region of one rank makes every operator the identity and issues nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist import comm, compat
from zerodist.comm import Group
from zerodist.comm.topology import Topology
from zerodist.tensor_parallel import schedule


@dataclasses.dataclass(frozen=True)
class TensorRegion:
    """This rank's tensor-parallel group: its process group, its size and this rank's index."""

    group: Group
    size: int
    rank: int

    @classmethod
    def of(cls, topology: Topology) -> TensorRegion:
        return cls(topology.group("tensor"), topology.size("tensor"), topology.axis_rank("tensor"))


class UnevenSplitError(ValueError):
    """A dimension does not split evenly over the tensor-parallel ranks (or Domino's chunks)."""


def check_divisible(length: int, parts: int, what: str) -> int:
    """`length // parts`, or an UnevenSplitError naming `what` and the fix."""
    if length % parts:
        raise UnevenSplitError(
            f"{what} has length {length}, which does not split evenly into {parts} parts; "
            f"choose a size divisible by {parts}"
        )
    return length // parts


# ------------------------------------------------------------------ collective building blocks
def _phase() -> str:
    # Inside autograd's backward pass the engine has a current graph task (-1 elsewhere, in
    # forwards of autograd functions included, which run with gradient mode off).
    return "backward" if compat.in_backward_pass() else "forward"


def all_reduce_(tensor: torch.Tensor, region: TensorRegion, async_op: bool = False) -> comm.CommHandle:
    """In place. Synchronous calls are counted in the schedule log; asynchronous ones are logged
    by their caller, which knows where it waits."""
    if not async_op:
        schedule.log_sync(_phase(), tensor.numel() * tensor.element_size())
    return comm.all_reduce(tensor, group=region.group, async_op=async_op)


def all_gather_dim(tensor: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (rank order)."""
    local = tensor.contiguous()
    # Flat buffers: gloo wants the output's shape to be the input's with dim 0 multiplied.
    gathered = torch.empty(region.size * local.numel(), dtype=local.dtype, device=local.device)
    schedule.log_sync(_phase(), gathered.numel() * gathered.element_size())
    comm.all_gather(gathered, local.view(-1), group=region.group)
    return torch.cat(gathered.view(region.size, *local.shape).unbind(0), dim=dim)


def reduce_scatter_dim(tensor: torch.Tensor, dim: int, region: TensorRegion, async_op: bool = False):
    """Sum `tensor` over the region and keep this rank's slice along `dim`.

    Returns the slice, or with `async_op=True` (the slice, its CommHandle): the slice holds the
    result once the handle is waited on."""
    check_divisible(tensor.shape[dim], region.size, f"dimension {dim} of a {tuple(tensor.shape)} tensor")
    stacked = torch.stack(tensor.chunk(region.size, dim=dim)).contiguous()
    output = torch.empty(stacked.shape[1:], dtype=tensor.dtype, device=tensor.device)
    if not async_op:
        schedule.log_sync(_phase(), stacked.numel() * stacked.element_size())
    handle = comm.reduce_scatter(output.view(-1), stacked.view(-1), group=region.group, async_op=async_op)
    return (output, handle) if async_op else output


def local_slice(tensor: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
    """This rank's slice of `tensor` along `dim` (a copy, so it owns its storage)."""
    length = check_divisible(tensor.shape[dim], region.size, f"dimension {dim} of a {tuple(tensor.shape)} tensor")
    return tensor.narrow(dim, region.rank * length, length).contiguous()


# ------------------------------------------------------------------ autograd functions
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
        ctx.region = region
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        all_reduce_(grad, ctx.region)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, region: TensorRegion, in_place: bool) -> torch.Tensor:
        if in_place and x.is_contiguous():
            # The caller made `x` (a partial product) and reads it nowhere else: reduce it where it
            # is. mark_dirty makes autograd refuse, loudly, a graph that saved it for backward.
            all_reduce_(x, region)
            ctx.mark_dirty(x)
            return x
        out = x.contiguous().clone()
        all_reduce_(out, region)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
        ctx.dim, ctx.region = dim, region
        return all_gather_dim(x, dim, region)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return local_slice(grad, ctx.dim, ctx.region), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
        ctx.dim, ctx.region = dim, region
        return local_slice(x, dim, region)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_dim(grad, ctx.dim, ctx.region), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
        ctx.dim, ctx.region = dim, region
        return all_gather_dim(x, dim, region)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_dim(grad, ctx.dim, ctx.region), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, region: TensorRegion) -> torch.Tensor:
        ctx.dim, ctx.region = dim, region
        return reduce_scatter_dim(x, dim, region)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_dim(grad, ctx.dim, ctx.region), None, None


def _positive_dim(dim: int, x: torch.Tensor) -> int:
    return dim % x.dim()


def copy_to_tensor_region(x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (before a column-parallel layer)."""
    return x if region.size == 1 else _CopyToRegion.apply(x, region)


def reduce_from_tensor_region(x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """g: all-reduce forward, identity backward (after a row-parallel layer)."""
    return x if region.size == 1 else _ReduceFromRegion.apply(x, region, False)


def reduce_from_tensor_region_(x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """g on a tensor the caller owns (a partial product it just computed and reads nowhere else):
    all-reduced in place, without the copy `reduce_from_tensor_region` makes to leave its input
    as it was."""
    return x if region.size == 1 else _ReduceFromRegion.apply(x, region, True)


def gather_from_tensor_region(x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice of the gradient."""
    return x if region.size == 1 else _GatherFromRegion.apply(x, x.dim() - 1, region)


def scatter_to_tensor_region(x: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return x if region.size == 1 else _ScatterToRegion.apply(x, x.dim() - 1, region)


def gather_from_sequence_region(x: torch.Tensor, region: TensorRegion, dim: int = -2) -> torch.Tensor:
    """Sequence parallelism: all-gather along the sequence `dim`; backward reduce-scatters."""
    return x if region.size == 1 else _GatherSequence.apply(x, _positive_dim(dim, x), region)


def gather_sequence_keep_slice(x: torch.Tensor, region: TensorRegion, dim: int = -2) -> torch.Tensor:
    """All-gather along the sequence `dim`; backward keeps this rank's slice of the gradient (for
    a gradient the layers after it made whole and equal on every tensor rank)."""
    return x if region.size == 1 else _GatherFromRegion.apply(x, _positive_dim(dim, x), region)


def reduce_scatter_to_sequence_region(x: torch.Tensor, region: TensorRegion, dim: int = -2) -> torch.Tensor:
    """Sequence parallelism: reduce-scatter along the sequence `dim`; backward all-gathers."""
    return x if region.size == 1 else _ReduceScatterSequence.apply(x, _positive_dim(dim, x), region)


def scatter_to_sequence_region(x: torch.Tensor, region: TensorRegion, dim: int = -2) -> torch.Tensor:
    """Sequence parallelism: keep this rank's slice of the sequence `dim`; backward all-gathers."""
    return x if region.size == 1 else _ScatterToRegion.apply(x, _positive_dim(dim, x), region)
