"""Sub-groups: the optimizer's tensors cut into runs of at most `sub_group_size` elements.

[Note: sub-groups] DeepSpeed's `sub_group_size` is how many elements of the flat fp32 shard are
stepped at a time; with swap files it is also the swap granularity: one sub-group's state is
read, stepped and written back while the others stay on disk, so host memory holds
`buffer_count` sub-groups of state, not the shard's. The optimizer tensors (this rank's flat
shards, in param-group order) are concatenated and cut every `sub_group_size` elements. A cut
inside a tensor falls on a multiple of `ALIGN` elements from the tensor's start, so every
element is computed by the same (vectorised or scalar) kernel loop as when the whole tensor is
stepped at once, and the result is bitwise the in-memory step's. `sub_group_size` 0 means no
limit (one sub-group), as DeepSpeed's huge default 1e9 does in practice.
"""

from __future__ import annotations

import dataclasses

ALIGN = 256  # elements: a multiple of every CPU vector width, and 1 KiB of fp32


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of the optimizer's tensor `position` of param group `group`."""

    group: int
    position: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class SubGroup:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(piece.length for piece in self.pieces)


def plan_subgroups(sizes: list[list[int]], sub_group_size: int) -> list[SubGroup]:
    """The sub-groups of tensors of `sizes[group][position]` elements ([Note: sub-groups])."""
    limit = max(ALIGN, sub_group_size // ALIGN * ALIGN) if sub_group_size > 0 else None
    planned: list[SubGroup] = []
    current: list[Piece] = []
    filled = 0

    def flush() -> None:
        nonlocal current, filled
        if current:
            planned.append(SubGroup(len(planned), tuple(current)))
        current, filled = [], 0

    for group, group_sizes in enumerate(sizes):
        for position, numel in enumerate(group_sizes):
            start = 0
            while start < numel:
                take = numel - start if limit is None else min(numel - start, limit - filled)
                if start + take < numel:
                    take = take // ALIGN * ALIGN  # a cut inside the tensor: on the alignment
                if take == 0:
                    flush()
                    continue
                current.append(Piece(group, position, start, take))
                filled += take
                start += take
                if limit is not None and filled >= limit:
                    flush()
    flush()
    return planned
