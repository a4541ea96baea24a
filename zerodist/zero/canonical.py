"""The layout-invariant mode (`zerodist.deterministic: "layout_invariant"`): the same bits for
every data degree x accumulation, ZeRO stage and one process ([../../docs/determinism.md]).

Every rank computes each micro-batch's gradient with the same kernels on the same shapes, so
the bits of a step depend only on which samples form micro-batch k and on the order in which
the K micro-batch gradients g_0..g_{K-1} (and the clip norm's squares, and the losses) are
added. This module fixes that order, for every layout.

[Note: the canonical tree] The sum of g_0..g_{K-1} is the binary counter's: leaves are pushed
in order k = 0, 1, ...; a new leaf is added to an equal-sized partial sum while one waits, so
after 2^n leaves the counter holds the balanced pairwise tree over them; `fold()` then adds what
is left, lowest (latest) partial first. IEEE addition is commutative (only its associativity
fails), so `older.add_(newer)` has the bits of `newer + older` and each sum can be made in place.

A sub-range of 2^n leaves starting at a multiple of 2^n is a complete subtree, and the counter
one level up runs over those subtrees exactly as the counter over the leaves would. Hence two
layouts reproduce the one-process sum (D = data degree, A = accumulation, K = D * A):
- contiguous (ZeRO 0/1, which accumulate locally and reduce once per step): data rank r runs
  micro-batches r*A .. r*A+A-1; its local sum is a subtree when A is a power of two, and the
  cross-rank reduction pushes the D subtree sums in rank order (any D).
- interleaved (ZeRO 2/3, which reduce every micro-step): at its micro-step j, data rank r runs
  micro-batch j*D + r; the micro-step's reduction over the D ranks (in rank order) is a subtree
  when D is a power of two, and each rank pushes the micro-steps' sums in order (any A).
The cross-rank reduction is an all-to-all (each rank receives every rank's piece of its own shard,
the (n-1)/n of the buffer a ring reduce-scatter moves) then the counter over the pieces; stage 0
gathers the reduced shards back (all-gather: the bytes of a ring all-reduce in all).

Scaling: the engine multiplies each loss by 1/A and divides the reduced sum by D; with both powers
of two that is exact, the bits of a division by K. The mode refuses other degrees by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.comm import collectives

MODE = "layout_invariant"
_NORM_BITS = 42  # each square's fixed-point share of the largest square: [Note: the exact norm]
_HALF_BITS = 31  # the all-reduce's split of each rank's total (int64 halves: exact to 2^52 elements)
_NORM_ROW = 512  # fixed-point squares added in fp64 at a time (exact: below 2^51)
_NORM_CHUNK = 1 << 20  # elements converted to fp64 at a time


class LayoutInvariantError(ValueError):
    """A layout the layout-invariant mode cannot make bitwise: refused by name at initialize()."""


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def interleaved(shard_gradients: bool) -> bool:
    """Whether micro-batches are dealt interleaved (ZeRO 2/3) rather than contiguous (ZeRO 0/1)."""
    return shard_gradients


def micro_batch_index(rank: int, step: int, data_degree: int, accumulation: int, shard_gradients: bool) -> int:
    """Which of the global batch's K = data_degree * accumulation micro-batches data rank `rank`
    feeds at its accumulation step `step` ([Note: the canonical tree])."""
    if interleaved(shard_gradients):
        return step * data_degree + rank
    return rank * accumulation + step


class CanonicalSum:
    """The binary counter over leaves pushed in order ([Note: the canonical tree]). It owns the
    tensors pushed (adds into them in place); the first one pushed ends up holding the sum."""

    def __init__(self, recycle: bool = False) -> None:
        self.levels: list[torch.Tensor | None] = []
        self.count = 0
        # recycle: buffers freed by a merge or a fold are kept and reused by push_copy(), so a counter
        # that copies its leaves (ZeRO 0/1) allocates its at most log2(A) buffers once, not every step
        self.recycle = recycle
        self.spares: list[torch.Tensor] = []

    def push_copy(self, leaf: torch.Tensor) -> None:
        """Push a copy of `leaf` (in a spare buffer when one is free)."""
        buffer = self.spares.pop() if self.spares else torch.empty_like(leaf)
        self.push(buffer.copy_(leaf))

    def _free(self, buffer: torch.Tensor) -> None:
        if self.recycle:
            self.spares.append(buffer)

    def push(self, leaf: torch.Tensor) -> None:
        carry, level = leaf, 0
        while level < len(self.levels) and self.levels[level] is not None:
            older = self.levels[level]
            assert older is not None
            self.levels[level] = None
            older.add_(carry)  # the bits of (older + newer): addition commutes
            self._free(carry)
            carry = older
            level += 1
        if level == len(self.levels):
            self.levels.append(None)
        self.levels[level] = carry
        self.count += 1

    def fold(self) -> torch.Tensor | None:
        """The sum of every leaf pushed (lowest partials first); the counter is empty after."""
        total: torch.Tensor | None = None
        for partial in self.levels:
            if partial is not None:
                total = partial if total is None else partial.add_(total)
        self.clear()
        return total

    def fold_into(self, leaf: torch.Tensor) -> None:
        """`leaf` is the last leaf: the sum of it and every leaf pushed lands in `leaf` itself
        (the bits of push(leaf) then fold())."""
        for partial in self.levels:
            if partial is not None:
                leaf.add_(partial)
                self._free(partial)
        self.clear()

    def clear(self) -> None:
        """Empty (the spare buffers are kept for the next window)."""
        self.levels, self.count = [], 0

    @property
    def extra_numel(self) -> int:
        return sum(t.numel() for t in self.levels if t is not None) + sum(t.numel() for t in self.spares)


def tree_sum(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical counter's sum of `leaves` in order (a new tensor; the leaves are not written)."""
    total = CanonicalSum()
    for leaf in leaves:
        total.push(leaf.clone())
    result = total.fold()
    assert result is not None, "tree_sum of no leaves"
    return result


class OrderedReduction:
    """A started ordered reduce-scatter (or all-reduce): `wait()` finishes it, as a CommHandle's."""

    def __init__(self, out: torch.Tensor, received: torch.Tensor, work: Any, gather_into: torch.Tensor | None,
                 group: Group):
        self.out, self.received, self.work, self.gather_into, self.group = out, received, work, gather_into, group

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            pieces = self.received.chunk(comm.get_world_size(self.group))
            total = CanonicalSum()
            self.out.copy_(pieces[0])
            total.push(self.out)
            for piece in pieces[1:]:
                total.push(piece)
            result = total.fold()
            assert result is self.out  # the first leaf holds the sum
            del self.received
            if self.gather_into is not None:
                comm.all_gather(self.gather_into, self.out, group=self.group)  # in place: out is this rank's slot
        return self.gather_into if self.gather_into is not None else self.out


def reduce_scatter(out: torch.Tensor, source: torch.Tensor, group: Group) -> OrderedReduction:
    """This rank's shard of the sum of every rank's `source`, added in rank order (async: `wait()`)."""
    received = torch.empty_like(source)
    work = collectives.all_to_all_single(received, source, group=group, async_op=True)
    return OrderedReduction(out, received, work, None, group)


def all_reduce(source: torch.Tensor, group: Group) -> OrderedReduction:
    """The sum of every rank's `source` into `source`, added in rank order: an ordered reduce-scatter
    then an all-gather (a ring all-reduce's bytes). Async: `wait()`."""
    n, rank = comm.get_world_size(group), comm.get_rank(group)
    shard = source.numel() // n
    out = source[rank * shard: (rank + 1) * shard]
    handle = reduce_scatter(out, source, group)
    handle.gather_into = source
    return handle


# [Note: the exact norm] The clip norm's sum of squares is made exact, so no order (over elements,
# shards or ranks) can change its bits: one all-reduce (max) finds the largest |g| over the world,
# m = f * 2^e with f in [0.5, 1); each square (g * 2^-e)^2 < 1 is exact in fp64 and becomes the
# integer round(square * 2^42), summed exactly (fp64 rows of integers, then int64 and Python ints);
# one all-reduce sums each rank's total, as two int64 halves, over the world, exactly. The result
# differs from the true sum of squares by at most half a unit of 2^-42 * 2^(2e) per element
# (relative to the sum at most N * 2^-41: the order of an fp32 sum's own rounding).
def exact_squares(pieces: Sequence[torch.Tensor], group: Group, device: torch.device) -> float:
    """The sum of squares of every rank's `pieces`, the same bits for any split into pieces or ranks."""
    largest = torch.zeros((), dtype=torch.float32, device=device)
    for piece in pieces:
        if piece.numel():
            largest = torch.maximum(largest, piece.detach().abs().max().float())
    if torch.isnan(largest):
        largest.fill_(math.inf)  # a max over ranks may drop a NaN; inf survives it (the step is skipped)
    comm.all_reduce(largest, op=comm.ReduceOp.MAX, group=group)
    biggest = float(largest)
    if not math.isfinite(biggest) or biggest == 0.0:
        halves = torch.zeros(2, dtype=torch.int64, device=device)
        comm.all_reduce(halves, group=group)  # every rank issues the same collectives on every path
        return biggest * biggest
    exponent = math.frexp(biggest)[1]
    scale = math.ldexp(1.0, -exponent)
    # Each fixed = round((g * scale * 2^21)^2) < 2^42 is an integer in fp64 (powers of two are exact);
    # rows of 512 add below 2^51, so fp64 adds them exactly in any order (every partial sum is an
    # integer below 2^53); a chunk's 2048 row sums add in int64 (below 2^62), chunks as Python ints.
    # Five passes over the chunk, about the default fp32 sum of squares' time.
    total = 0
    lift = scale * float(1 << (_NORM_BITS // 2))
    for piece in pieces:
        flat = piece.detach().reshape(-1)
        for start in range(0, flat.numel(), _NORM_CHUNK):
            fixed = flat[start: start + _NORM_CHUNK].to(torch.float64, copy=True).mul_(lift).square_().round_()  # never the gradient itself (an fp64 one)
            whole = fixed.numel() - fixed.numel() % _NORM_ROW
            total += int(fixed[:whole].view(-1, _NORM_ROW).sum(1).long().sum()) + int(fixed[whole:].sum())
    halves = torch.tensor([total >> _HALF_BITS, total & ((1 << _HALF_BITS) - 1)], dtype=torch.int64, device=device)
    comm.all_reduce(halves, group=group)
    high, low = (int(v) for v in halves.tolist())
    total = (high << _HALF_BITS) + low
    return math.ldexp(float(total), -_NORM_BITS) / (scale * scale)


def loss_mean(losses: Sequence[torch.Tensor], group: Group, *, accumulation: int, shard_gradients: bool) -> torch.Tensor:
    """The mean of the global batch's K micro-batch losses, summed by the canonical tree in
    micro-batch order on every rank (one all-gather of this rank's A losses)."""
    n = comm.get_world_size(group)
    mine = torch.stack([loss.detach().float().reshape(()) for loss in losses])
    every = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather(every, mine, group=group)
    by_index: dict[int, torch.Tensor] = {}
    for rank in range(n):
        for step in range(accumulation):
            by_index[micro_batch_index(rank, step, n, accumulation, shard_gradients)] = every[rank * accumulation + step]
    total = CanonicalSum()
    for index in sorted(by_index):
        total.push(by_index[index].clone())
    result = total.fold()
    assert result is not None
    return result / len(by_index)


EXPERT_PIPE_SCHEDULES = ("1f1b", "gpipe", "zb")  # tested with experts in the mode


def check_layout(*, data_degree: int, accumulation: int, stage: int, pipe: int, sequence: int, expert: int,
                 fp16: bool, tensor_sequence_parallel: bool = False, reduction_keys: tuple[str, ...] = (),
                 schedule: str = "1f1b", pipeline: bool = False) -> None:
    """Refuse, by name, what the mode cannot make bitwise (config arithmetic: every rank raises alike,
    before any collective of the techniques). Tensor parallelism is allowed: bitwise across data
    layouts and stages at a fixed tensor degree, not to one process (docs/determinism.md). `pipeline`:
    a PipelineModule is trained, also at `pipe` 1 (all its stages on one rank)."""
    problems = []
    if sequence > 1:
        problems.append(f"sequence parallelism (degree {sequence}) is not supported by the mode yet")
    # an expert's per-source gradients are summed by the tree in micro-batch order ([Note: experts in
    # the mode] in zerodist/moe/ordered.py): any power-of-two degree, at every ZeRO stage
    if not is_power_of_two(expert):
        problems.append(f"the expert-parallel degree {expert} is not a power of two")
    if expert > 1 and (pipe > 1 or pipeline) and schedule not in EXPERT_PIPE_SCHEDULES:
        problems.append(f"experts with the {schedule!r} pipeline schedule (an expert's per-source gradients are "
                        f"ordered by its stage's backward count, checked for {', '.join(EXPERT_PIPE_SCHEDULES)} "
                        "only); use one of those")
    if tensor_sequence_parallel:
        problems.append("zerodist.tensor_parallel.sequence_parallel (Megatron's) reduces partial gradients over "
                        "data x tensor together, which the mode does not order yet")
    if fp16:
        problems.append("fp16 (dynamic loss scaling) is not supported by the mode; use fp32 or bf16")
    if reduction_keys:  # they choose their own summation order or values (MiCS, ZeRO++, a cast)
        problems.append(f"{', '.join(reduction_keys)} change how gradients are reduced or weights gathered, "
                        "which the mode does not order; remove them")
    if not is_power_of_two(data_degree):
        problems.append(f"the data-parallel degree {data_degree} is not a power of two")
    if not is_power_of_two(accumulation):
        problems.append(f"gradient_accumulation_steps {accumulation} is not a power of two")
    if problems:
        raise LayoutInvariantError(
            f"zerodist.deterministic: {MODE!r} (stage {stage}) cannot give layout-invariant bits here: "
            + "; ".join(problems) + ". Change the layout, or drop zerodist.deterministic (docs/determinism.md)")
