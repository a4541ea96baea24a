"""Layout arithmetic for flat buffers: pure functions over sizes, no tensors, no processes.

A group of parameters is packed, in a given order, into one flat buffer made of buckets.
Each bucket holds whole parameters (a parameter larger than the bucket capacity gets a
bucket of its own) and is padded so it splits into `world_size` equal shards whose length is
a multiple of `ALIGN` elements. Rank r owns shard r *of every bucket*: that is what lets a
bucket's gradients be reduce-scattered straight into their owners as soon as the bucket is
full (Megatron's distributed optimizer does the same).

[Note: alignment] Shards are multiples of 64 elements so that the optimizer's elementwise
kernels take their vectorised path over whole shards whatever the world size or stage; with
the same inputs they then produce the same bits, which is what makes stages 0, 1 and 2
bitwise identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where parameter `index` (its position in the group) lives in the flat buffer."""

    index: int
    offset: int
    numel: int
    bucket: int


@dataclasses.dataclass(frozen=True)
class BucketSpan:
    """A bucket: `numel` elements from `offset`, padded; `shard_numel` per rank."""

    index: int
    offset: int
    numel: int
    shard_numel: int
    param_indices: tuple[int, ...]

    def shard_offset(self, rank: int) -> int:
        return self.offset + rank * self.shard_numel


@dataclasses.dataclass(frozen=True)
class OwnedSlice:
    """Part of a parameter that one rank owns: `length` elements starting at `param_start`
    (flattened), stored at `shard_start` in that rank's concatenated shard."""

    param_index: int
    param_start: int
    length: int
    shard_start: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    buckets: tuple[BucketSpan, ...]
    world_size: int

    @property
    def total_numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns, over all buckets (padding included)."""
        return sum(b.shard_numel for b in self.buckets)

    @property
    def padding(self) -> int:
        return self.total_numel - sum(s.numel for s in self.slots)

    def owned_slices(self, rank: int) -> list[OwnedSlice]:
        """The pieces of each parameter that `rank` owns, in shard order."""
        result = []
        shard_start = 0
        for bucket in self.buckets:
            lo, hi = bucket.shard_offset(rank), bucket.shard_offset(rank) + bucket.shard_numel
            for index in bucket.param_indices:
                slot = self.slots[index]
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < end:
                    result.append(OwnedSlice(index, start - slot.offset, end - start, shard_start + start - lo))
            shard_start += bucket.shard_numel
        return result


def padded_numel(numel: int, world_size: int, align: int = ALIGN) -> int:
    unit = world_size * align
    return max(unit, -(-numel // unit) * unit)


def plan_layout(numels: Sequence[int], *, bucket_numel: int, world_size: int, align: int = ALIGN) -> FlatLayout:
    """Pack parameters of `numels` (in this order) into buckets of at most `bucket_numel`
    elements (before padding), each padded to a multiple of `world_size * align`."""
    if world_size < 1 or bucket_numel < 1:
        raise ValueError(f"world_size ({world_size}) and bucket_numel ({bucket_numel}) must be >= 1")
    groups: list[list[int]] = []
    filled = 0
    for index, numel in enumerate(numels):
        if not groups or (filled + numel > bucket_numel and groups[-1]):
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += numel
    slots: list[ParamSlot | None] = [None] * len(numels)
    buckets = []
    offset = 0
    for bucket_index, members in enumerate(groups):
        cursor = offset
        for index in members:
            slots[index] = ParamSlot(index, cursor, numels[index], bucket_index)
            cursor += numels[index]
        numel = padded_numel(cursor - offset, world_size, align)
        buckets.append(BucketSpan(bucket_index, offset, numel, numel // world_size, tuple(members)))
        offset += numel
    return FlatLayout(tuple(s for s in slots if s is not None), tuple(buckets), world_size)


def slice_runs(start: int, length: int, *, shape: Sequence[int], dim: int | None, part: int,
               num_parts: int) -> list[tuple[int, int, int]]:
    """Where elements [start, start + length) of a slice, flattened, lie in the flattened logical
    tensor: `(logical start, run length, offset in the range)` for each contiguous run.

    The slice is part `part` of `num_parts` equal parts of the logical tensor along `dim`, and
    has `shape` (so the logical tensor has `shape[dim] * num_parts` there). Within the slice,
    each block of `inner = shape[dim] * prod(shape[dim + 1:])` elements is contiguous in the
    logical tensor too; block `b` starts at `b * inner * num_parts + part * inner`. A whole
    tensor (`dim` None or one part) is one run."""
    if dim is None or num_parts == 1:
        return [(start, length, 0)] if length else []
    inner = 1
    for n in shape[dim:]:
        inner *= n
    runs = []
    position, end = start, start + length
    while position < end:
        block, within = divmod(position, inner)
        run = min(end - position, inner - within)
        runs.append((block * inner * num_parts + part * inner + within, run, position - start))
        position += run
    return runs
