"""Where a tensor-parallel slice's elements live in its logical (unsliced) tensor.

Checkpoints describe every parameter in its logical coordinates (the flat element index of the
unparallelized tensor), so a checkpoint saved at one tensor degree loads at any other. An even
split is `zerodist.zero.layout.slice_runs`; this module serves the placements that refine it
(`Placement.fused`, `Placement.logical_size`), through `zerodist.checkpoint.shards.logical_runs`. A slice's
elements are not contiguous there in general (a row-parallel weight `[out, in/t]` holds one run
of `in/t` elements per row; a fused QKV slice three runs of rows; a padded vocabulary slice may
end in rows that exist in no logical tensor), so a range of the local flat tensor maps to a list
of runs. The arithmetic is pure and vectorised (one int64 per element of the range).
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist.tensor_parallel.layers import SliceSpec


@dataclasses.dataclass(frozen=True)
class ParamSlicing:
    """One parameter's slice: `spec` cut over `size` ranks, this rank holding part `rank`."""

    spec: SliceSpec
    local_shape: tuple[int, ...]
    rank: int
    size: int

    @property
    def logical_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.spec.dim] = self.spec.logical_size
        return tuple(shape)

    def _logical_index_along_dim(self) -> torch.Tensor:
        """For each local index along the sliced dim, its logical index (-1: padding)."""
        local = self.local_shape[self.spec.dim]
        parts = self.spec.fused or (self.spec.padded_size or self.spec.logical_size,)
        mapping, base = [], 0
        for part in parts:
            per_rank = part // self.size
            mapping.append(torch.arange(per_rank) + base + self.rank * per_rank)
            base += part
        index = torch.cat(mapping)
        assert index.numel() == local, (index.numel(), local)
        return torch.where(index < self.spec.logical_size, index, torch.full_like(index, -1))

    def runs(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """Local flat elements [start, start + length) as runs (logical start, length, offset
        from `start`); padding elements belong to no run."""
        dim = self.spec.dim
        outer = 1
        for d in self.local_shape[:dim]:
            outer *= d
        inner = 1
        for d in self.local_shape[dim + 1:]:
            inner *= d
        local_dim, logical_dim = self.local_shape[dim], self.spec.logical_size
        flat = torch.arange(start, start + length, dtype=torch.int64)
        o, rest = flat // (local_dim * inner), flat % (local_dim * inner)
        j, i = rest // inner, rest % inner
        logical_j = self._logical_index_along_dim()[j]
        logical = (o * logical_dim + logical_j) * inner + i
        valid = logical_j >= 0
        # A run breaks where the logical index does not step by one, or validity changes.
        breaks = torch.ones(length, dtype=torch.bool)
        if length > 1:
            breaks[1:] = (logical[1:] != logical[:-1] + 1) | (valid[1:] != valid[:-1])
        starts = torch.nonzero(breaks).flatten().tolist() + [length]
        return [(int(logical[a]), b - a, a) for a, b in zip(starts[:-1], starts[1:]) if bool(valid[a])]
