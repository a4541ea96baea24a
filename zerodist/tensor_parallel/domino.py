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
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerodist.compat import register_pytree_node
from zerodist.tensor_parallel import schedule
from zerodist.tensor_parallel.chunks import (ChunkRunner, IssueReduction, PendingReduction, WaitReduction, chunk_turn,
                                             saved_tensor_hooks_now)
from zerodist.tensor_parallel.conv1d import RowParallelConv1D
from zerodist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from zerodist.tensor_parallel.operators import TensorRegion, UnevenSplitError
from zerodist.utils.unfinished import UnfinishedOutput

OVERLAPS = ("intra", "inter")


class DominoChunkError(UnevenSplitError):
    """The batch does not split into Domino's k chunks evenly."""


class DominoJoinError(TypeError):
    """A block run in turns returns a 0-dim tensor, and nothing says how to join the chunks' values."""


# How a block's 0-dim outputs join over the chunks ([Note: Domino's scalar join]); None: refused.
SCALAR_JOINS = ("mean", "sum")


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


class ChunkedActivations:
    """The residual stream split into k chunks, each with the branch output still being reduced."""

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks = chunks
        self.pending: list[tuple[torch.Tensor, PendingReduction, ResidualBranch] | None] = [None] * len(chunks)

    def resolve(self, index: int) -> torch.Tensor:
        """Chunk `index` with its pending branch output waited for and added."""
        entry = self.pending[index]
        if entry is not None:
            reduced, pending, branch = entry
            self.chunks[index] = self.chunks[index] + branch.finish(WaitReduction.apply(reduced, pending))
            schedule.log_compute("forward", "finish")
            self.pending[index] = None
        return self.chunks[index]

    def issue(self, index: int, x: torch.Tensor, branch: ResidualBranch, region: TensorRegion) -> None:
        partial = branch.body(x)
        schedule.log_compute("forward", "body")
        pending = PendingReduction()
        self.chunks[index] = x
        self.pending[index] = (IssueReduction.apply(partial, region, pending), pending, branch)

    def join(self) -> torch.Tensor:
        return torch.cat([self.resolve(i) for i in range(len(self.chunks))], dim=0)


def _flatten_chunks(state: ChunkedActivations) -> tuple[list[Any], Any]:
    """[Note: Domino at ZeRO-3] The tensors a block hands on in a `ChunkedActivations`, as pytree
    leaves: ZeRO-3 arms a unit's backward gather on the tensors of its output, which it finds with
    torch's pytree; an opaque object would leave the block ungathered for its backward."""
    leaves: list[Any] = list(state.chunks) + [entry[0] if entry is not None else None for entry in state.pending]
    return leaves, state


def _unflatten_chunks(leaves: Any, state: ChunkedActivations) -> ChunkedActivations:
    return state  # the leaves are only read (hooks on them), never replaced


register_pytree_node(ChunkedActivations, _flatten_chunks, _unflatten_chunks)


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


def apply_domino(blocks: nn.ModuleList, branches: Callable[[nn.Module], Sequence[ResidualBranch]] | None,
                 region: TensorRegion | None, config: DominoConfig, *, scalar_join: str | None = None
                 ) -> nn.ModuleList:
    """Run every block of `blocks` by the Domino schedule (in place); the blocks must run in
    list order, each on the previous one's output.

    With `branches` (a function giving a block's residual branches) each block becomes a
    `DominoBlock` running them; with `branches=None` each block runs its own forward with the
    chunks taking turns (`chunks.py`): any block whose row-parallel layers were made by
    `parallelize` (a Hugging Face decoder layer, a `layer_specs` model's block).

    `scalar_join` ("mean" or "sum"; blocks run in turns only): how a 0-dim tensor a block returns
    (an auxiliary loss) joins over the chunks; without it such an output is a `DominoJoinError`
    ([Note: Domino's scalar join])."""
    if scalar_join is not None and scalar_join not in SCALAR_JOINS:
        raise ValueError(f"scalar_join must be one of {SCALAR_JOINS} or None, got {scalar_join!r}")
    for index, block in enumerate(list(blocks)):
        sequence_parallel = [n for n, m in block.named_modules()
                             if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel]
        if sequence_parallel:
            raise ValueError(f"block {index} has sequence-parallel layers ({', '.join(sequence_parallel)}); Domino "
                             "reduces with all-reduces: parallelize without sequence parallelism")
        if isinstance(block, (DominoBlock, DominoTurns)):
            raise ValueError(f"block {index} already runs the Domino schedule")
        is_last = index == len(blocks) - 1
        if branches is None:
            blocks[index] = _turn_block(block, config, is_last, scalar_join)
        else:
            if region is None:
                raise ValueError("apply_domino with residual branches needs the tensor region")
            blocks[index] = DominoBlock(block, branches, region, config, is_last=is_last)
    return blocks


ROW_LAYERS = (RowParallelLinear, RowParallelConv1D)


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks: the outermost `nn.ModuleList` whose entries are all of one
    class and each hold a row-parallel layer (Hugging Face's `model.layers` / `transformer.h`, a
    `layer_specs` model's block list). A ValueError naming the candidates when there is not one."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _ in found) or not isinstance(module, nn.ModuleList):
            continue
        entries = list(module)
        if entries and all(type(e) is type(entries[0]) and any(isinstance(m, ROW_LAYERS) for m in e.modules())
                           for e in entries):
            found.append((name, module))
    if len(found) != 1:
        raise ValueError(f"Domino needs the model's blocks: one nn.ModuleList of blocks holding row-parallel layers; "
                         f"{type(model).__name__} has {len(found)} ({', '.join(n for n, _ in found) or 'none'}); "
                         "call zerodist.tensor_parallel.apply_domino(blocks, None, region, config) yourself")
    return found[0][1]


# ------------------------------------------------------------------ any block: chunks taking turns
@dataclasses.dataclass
class _TurnSettings:
    config: DominoConfig
    is_last: bool
    scalar_join: str | None = None  # how 0-dim outputs join over the chunks ([Note: Domino's scalar join])
    issues: int | None = None  # reductions per chunk in one call of the block, learned from the first


class DominoTurns(nn.Module):
    """Mixed into a subclass of a block's own class (`Domino<class>`): its forward runs the
    class's forward once per chunk, the chunks taking turns at the row-parallel reductions."""

    _domino: _TurnSettings

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = super().forward
        if args:
            return _run_in_turns(self, forward, args[0], args[1:], kwargs)
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(self).__name__} is called without its hidden states (first argument or "
                            "hidden_states=)")
        x = kwargs.pop("hidden_states")
        return _run_in_turns(self, lambda value, *rest, **named: forward(*rest, hidden_states=value, **named),
                             x, (), kwargs)


@functools.lru_cache(maxsize=None)
def _turn_class(base: type) -> type:
    return type(f"Domino{base.__name__}", (DominoTurns, base), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} run by Domino's schedule (built by zerodist.tensor_parallel.apply_domino).",
    })


def _turn_block(block: nn.Module, config: DominoConfig, is_last: bool, scalar_join: str | None = None) -> nn.Module:
    """A new module of class `Domino<type(block)>` holding the block's children, parameters,
    buffers, hooks and attributes (the same `state_dict()` keys); the block itself is untouched."""
    cls = _turn_class(type(block))  # type: ignore[arg-type]
    new = cls.__new__(cls)  # type: ignore[call-overload]
    new.__dict__.update({key: (type(value)(value) if isinstance(value, (dict, set)) else value)
                         for key, value in vars(block).items()})
    new._domino = _TurnSettings(config, is_last, scalar_join)
    return new


class DominoStreamError(TypeError):
    """A model read a block's output between Domino blocks under inter-layer overlap."""


class ChunkedStream(UnfinishedOutput):
    """What a block returns to the next one under inter-layer overlap: the chunks, some still
    inside this block (parked at their last reduction). Only the next Domino block reads their
    values; its `shape`, `dtype` and `device` are those of the block's input (a residual block's
    output has them), so glue between the blocks that computes positions, rotary embeddings or a
    causal mask from the hidden states' shape (a pipeline stage's: zerodist/pipe/split_plans.py)
    runs unchanged. The block is done when its last chunk has left it: `when_finished` ([Note:
    unfinished outputs] in zerodist/utils/unfinished.py; ZeRO-3 keeps the block gathered until then)."""

    def __init__(self, runner: ChunkRunner, batch: int, like: Any, item: int):
        self._runner, self._batch, self._item = runner, batch, item
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self._finalizer = weakref.finalize(self, runner.close)  # a forward abandoned between blocks

    def take(self) -> tuple[ChunkRunner, int]:
        self._finalizer.detach()
        return self._runner, self._batch

    def when_finished(self, callback: Callable[[list[Any]], None]) -> None:
        """`callback(outputs)`, each chunk's output of this block, once every chunk has left it."""
        self._runner.when_done(self._item, callback)

    def __getattr__(self, name: str) -> Any:
        raise DominoStreamError(f"the model read .{name} of a block's output between Domino blocks; with "
                                '"overlap": "inter" the chunks pass from block to block unjoined: use "intra"')


def _flatten_stream(stream: ChunkedStream) -> tuple[list[Any], Any]:
    """[Note: Domino at ZeRO-3] The tensors a block hands on in a `ChunkedStream`: each chunk's
    value when it finished the block, else the reduction it is parked at, as pytree leaves, so that
    ZeRO-3 arms the block's backward gather on them (as for `ChunkedActivations`)."""
    leaves: list[Any] = [chunk.parked_at if chunk.running else chunk.value for chunk in stream._runner.chunks]
    return leaves, stream


def _unflatten_stream(leaves: Any, stream: ChunkedStream) -> ChunkedStream:
    return stream  # the leaves are only read (hooks on them), never replaced


register_pytree_node(ChunkedStream, _flatten_stream, _unflatten_stream)


def _is_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _split_argument(value: Any, batch: int, chunks: int) -> list[Any]:
    """One value per chunk: tensors of two or more dims whose dim 0 is the batch are split along it
    (masks, rotary embeddings, position ids); tuples, lists and dicts element by element; a
    key/value cache is dropped (None: Domino trains, and chunks must not share one); the rest kept."""
    if isinstance(value, torch.Tensor):
        return list(value.chunk(chunks)) if value.dim() >= 2 and value.shape[0] == batch else [value] * chunks
    if type(value) in (tuple, list):
        parts = [_split_argument(v, batch, chunks) for v in value]
        return [type(value)(part[i] for part in parts) for i in range(chunks)]
    if type(value) is dict:
        split = {key: _split_argument(v, batch, chunks) for key, v in value.items()}
        return [{key: part[i] for key, part in split.items()} for i in range(chunks)]
    if value is not None and _is_cache(value):
        return [None] * chunks
    return [value] * chunks


# [Note: Domino's scalar join] A block's 0-dim output (an auxiliary loss) has no batch dimension to
# concatenate the chunks' values along, and no one join is right for all: a sum over tokens joins by
# summing, a per-token mean by the mean (exact only for equal chunks), and a product of per-token
# means, such as an MoE balance loss (the fraction routed to each expert times its mean gate), by
# neither: each chunk's is computed from its own tokens. So a 0-dim output is refused unless the
# caller of `apply_domino` declares the join (`scalar_join`); the demo MoE GPT's plan declares "mean",
# its routing statistics and capacity being per chunk (docs/tensor_parallel.md).
def _join(values: list[Any], scalar_join: str | None, block: str) -> Any:
    """The chunks' outputs as one: tensors concatenated along the batch; a 0-dim tensor by
    `scalar_join` (a `DominoJoinError` without one); tuples element by element."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim():
            return torch.cat(values, dim=0)
        if scalar_join is None:
            raise DominoJoinError(f"{block} returns a 0-dim tensor (an auxiliary loss?), which Domino cannot join "
                                  "over its chunks by concatenation: pass scalar_join='mean' or 'sum' to "
                                  "zerodist.tensor_parallel.apply_domino if that joins it exactly, else leave "
                                  "Domino off for this model")
        stacked = torch.stack(values)
        return stacked.mean(dim=0) if scalar_join == "mean" else stacked.sum(dim=0)
    if type(first) is tuple:
        return tuple(_join([value[i] for value in values], scalar_join, block) for i in range(len(first)))
    return first


def _run_in_turns(block: DominoTurns, forward: Callable[..., Any], x: Any, args: tuple, kwargs: dict) -> Any:
    settings = block._domino
    chunks = settings.config.chunks
    if isinstance(x, ChunkedStream):
        runner, batch = x.take()
    else:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"a Domino block's first argument is its hidden states (a tensor), got {type(x).__name__}")
        batch = x.shape[0]
        split_batch(x, chunks)  # the named error for a batch k does not divide
        runner = ChunkRunner(list(x.chunk(chunks, dim=0)))
    inter = settings.config.overlap == "inter" and not settings.is_last
    per_chunk_args = _split_argument(args, batch, chunks)
    per_chunk_kwargs = _split_argument(kwargs, batch, chunks)
    hooks = saved_tensor_hooks_now()  # this block call's (ZeRO-3's unit hooks): [Note: hooks into chunks]

    def item(chunk_args: tuple, chunk_kwargs: dict) -> Callable[[Any], Any]:
        def run(value: Any) -> Any:
            with runner.thread_state(hooks):
                out = forward(value, *chunk_args, **chunk_kwargs)
            turn = chunk_turn()
            settings.issues = turn.issues if turn is not None else settings.issues
            schedule.log_compute("forward", "finish")
            if inter and not isinstance(out, torch.Tensor):
                raise DominoStreamError(f"{type(block).__name__} returns a {type(out).__name__}; inter-layer overlap "
                                        'passes each chunk\'s tensor to the next block: use "overlap": "intra"')
            return out
        return run

    runner.submit([item(a, k) for a, k in zip(per_chunk_args, per_chunk_kwargs)])
    if inter:
        # Every chunk may wait at its last reduction of this block, under the next block's chunks.
        runner.run(lambda chunk: not chunk.queue and settings.issues is not None and chunk.issues >= settings.issues)
        return ChunkedStream(runner, batch, x, runner.items - 1)
    runner.run()
    values = runner.values()
    runner.close()
    return _join(values, settings.scalar_join, type(block).__name__)
