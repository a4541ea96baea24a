"""Domino: each transformer block's batch split into k chunks, so that the tensor-parallel
all-reduce of chunk i runs while chunk i+1 computes.

A block is a list of *residual branches* `x -> x + finish(all_reduce(body(x)))`, where `body`
ends with a row-parallel layer's local partial product (`RowParallelLinear.partial`) and
`finish` adds the bias and applies the branch's dropout. The schedule is a loop:

    for branch in block's branches:
        for i in range(k):
            x_i = resolve(i)                       # wait chunk i's previous reduction, add it
            pending[i] = issue(all_reduce(body(x_i)))  # asynchronous

so chunk i's reduction is waited only when chunk i is needed again: after chunks i+1 .. k-1 of
the same branch have computed (intra-layer), and for the last branch, after the next block's
first chunks (inter-layer: the blocks pass the chunks and their pending reductions to each
other). With `overlap="intra"` every block resolves its chunks before it returns. Handles live in
the chunk state passed from block to block, scoped to one forward: no globals.

Backward: the asynchronous reduction's adjoint is the identity (g's), and each column-parallel
layer issues its input-gradient all-reduce before its weight-gradient matmul (see
`layers._ColumnLinearFunction`), so every chunk's backward reduction runs under that matmul.

Blocks are swapped in place (`apply_domino`) for `DominoBlock`s holding the same children, so the
model's `state_dict()` keys do not change and a model that calls `x = block(x)` in a loop (the
demo GPT) runs the schedule unchanged; between blocks `x` is a `ChunkedActivations`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zerodist.comm import CommHandle
from zerodist.tensor_parallel import schedule
from zerodist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from zerodist.tensor_parallel.operators import TensorRegion, UnevenSplitError, all_reduce_

OVERLAPS = ("intra", "inter")


class DominoChunkError(UnevenSplitError):
    """The batch does not split into Domino's k chunks evenly."""


@dataclasses.dataclass(frozen=True)
class DominoConfig:
    chunks: int = 2
    overlap: str = "inter"

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 2:
            raise ValueError(f"domino chunks must be an int >= 2, got {self.chunks!r} (1 chunk is plain tensor "
                             "parallelism: leave Domino off)")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"domino overlap must be 'intra' or 'inter', got {self.overlap!r}")


@dataclasses.dataclass(frozen=True)
class ResidualBranch:
    body: Callable[[torch.Tensor], torch.Tensor]    # x -> the row-parallel partial product
    finish: Callable[[torch.Tensor], torch.Tensor]  # the reduced product -> the branch output


class _PendingReduction:
    __slots__ = ("handle", "collective")

    def __init__(self) -> None:
        self.handle: CommHandle | None = None
        self.collective = -1


class _IssueReduction(torch.autograd.Function):
    """Forward: start the all-reduce of (a copy of) `partial`; backward: identity (g's adjoint)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, region: TensorRegion, pending: _PendingReduction):
        out = partial.contiguous().clone()
        pending.collective = schedule.log_issue("forward", out.numel() * out.element_size())
        pending.handle = all_reduce_(out, region, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _WaitReduction(torch.autograd.Function):
    """Forward: wait for the reduction started by `_IssueReduction`; backward: identity."""

    @staticmethod
    def forward(ctx, reduced: torch.Tensor, pending: _PendingReduction):
        schedule.wait(pending.handle, pending.collective, "forward")
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ChunkedActivations:
    """The residual stream split into k chunks, each with the branch output still being reduced."""

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks = chunks
        self.pending: list[tuple[torch.Tensor, _PendingReduction, ResidualBranch] | None] = [None] * len(chunks)

    def resolve(self, index: int) -> torch.Tensor:
        """Chunk `index` with its pending branch output waited for and added."""
        entry = self.pending[index]
        if entry is not None:
            reduced, pending, branch = entry
            self.chunks[index] = self.chunks[index] + branch.finish(_WaitReduction.apply(reduced, pending))
            schedule.log_compute("forward", "finish")
            self.pending[index] = None
        return self.chunks[index]

    def issue(self, index: int, x: torch.Tensor, branch: ResidualBranch, region: TensorRegion) -> None:
        partial = branch.body(x)
        schedule.log_compute("forward", "body")
        pending = _PendingReduction()
        self.chunks[index] = x
        self.pending[index] = (_IssueReduction.apply(partial, region, pending), pending, branch)

    def join(self) -> torch.Tensor:
        return torch.cat([self.resolve(i) for i in range(len(self.chunks))], dim=0)


def split_batch(x: torch.Tensor, chunks: int) -> ChunkedActivations:
    if x.shape[0] % chunks:
        raise DominoChunkError(f"Domino splits the batch into {chunks} chunks, but the batch has {x.shape[0]} "
                               f"samples; use a micro-batch size divisible by {chunks}")
    return ChunkedActivations(list(x.chunk(chunks, dim=0)))


class DominoBlock(nn.Module):
    """A block run by the Domino schedule. It holds the original block's children under their own
    names; `branches(block)` returns its residual branches in order."""

    def __init__(self, block: nn.Module, branches: Callable[[nn.Module], Sequence[ResidualBranch]],
                 region: TensorRegion, config: DominoConfig, *, is_last: bool):
        super().__init__()
        for name, child in block.named_children():
            self.register_module(name, child)
        self._branches = branches
        self.region, self.config, self.is_last = region, config, is_last

    def forward(self, x: torch.Tensor | ChunkedActivations) -> torch.Tensor | ChunkedActivations:
        state = split_batch(x, self.config.chunks) if isinstance(x, torch.Tensor) else x
        for branch in self._branches(self):
            for index in range(len(state.chunks)):
                state.issue(index, state.resolve(index), branch, self.region)
        if self.is_last or self.config.overlap == "intra":
            return state.join()
        return state


def apply_domino(blocks: nn.ModuleList, branches: Callable[[nn.Module], Sequence[ResidualBranch]],
                 region: TensorRegion, config: DominoConfig) -> nn.ModuleList:
    """Swap every block of `blocks` for a `DominoBlock` (in place); the blocks must run in
    list order, each on the previous one's output."""
    for index, block in enumerate(list(blocks)):
        sequence_parallel = [n for n, m in block.named_modules()
                             if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel]
        if sequence_parallel:
            raise ValueError(f"block {index} has sequence-parallel layers ({', '.join(sequence_parallel)}); Domino "
                             "reduces with all-reduces: parallelize without sequence parallelism")
        if isinstance(block, DominoBlock):
            raise ValueError(f"block {index} already runs the Domino schedule")
        blocks[index] = DominoBlock(block, branches, region, config, is_last=index == len(blocks) - 1)
    return blocks
