"""A sliced tensor and its logical tensor: where a slice's elements lie in it, how to cut a slice
from it, and how to join every rank's slices back into it.

A parameter whose placement (`zerodist.comm.domains.Placement`) cuts dimension `slice_dim` over
a mesh axis holds one part of a larger logical (unparallelized) tensor. The technique that cuts
it (tensor parallelism's layers) and the code that saves, loads and exports it (checkpoint/) use
this one arithmetic; checkpoint/ builds it from the declared placement and the topology
(`param_slicings`), so it never needs to know which technique made a slice.

An even split is `zerodist.zero.layout.slice_runs`; the arithmetic here also serves the
placements that refine it (`Placement.fused`, `Placement.logical_size`). A slice's elements are
not contiguous in the logical tensor in general (a row-parallel weight `[out, in/t]` holds one run
of `in/t` elements per row; a fused QKV slice three runs of rows; a padded vocabulary slice may
end in rows that exist in no logical tensor), so a range of the local flat tensor maps to a list
of runs. The arithmetic is pure and vectorised (one int64 per element of the range).
"""

from __future__ import annotations

import dataclasses
import torch

from zerodist.comm.collectives import all_gather
from zerodist.comm.domains import Placement, parameter_placements
from zerodist.comm.topology import Topology


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """How a parameter was cut from its logical tensor."""

    dim: int                        # the logical tensor's dim that is split
    logical_size: int               # its length along `dim` before padding
    fused: tuple[int, ...] = ()     # sub-parameter lengths along `dim`, split one by one
    padded_size: int | None = None  # the padded length (vocabularies), None if unpadded

    @classmethod
    def of(cls, placement: Placement, local_shape: tuple[int, ...], num_parts: int) -> SliceSpec:
        """The cut a sliced `placement` describes, for a part of shape `local_shape`: the
        padded length is the parts' total, the logical length the placement's (or that total)."""
        assert placement.slice_dim is not None, placement
        dim = placement.slice_dim
        padded = local_shape[dim] * num_parts
        logical = placement.logical_size or padded
        return cls(dim, logical, tuple(placement.fused), padded_size=padded if padded != logical else None)


def cut_slice(full: torch.Tensor, spec: SliceSpec, part: int, num_parts: int) -> torch.Tensor:
    """Part `part` of `num_parts` of the logical tensor `full` (padded first when
    `spec.padded_size`; each fused sub-tensor split on its own). A copy: it owns its storage."""
    if spec.padded_size is not None and spec.padded_size != full.shape[spec.dim]:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded_size - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    pieces = full.split(list(spec.fused), dim=spec.dim) if spec.fused else (full,)
    local = []
    for piece in pieces:
        length = piece.shape[spec.dim] // num_parts
        if length * num_parts != piece.shape[spec.dim]:
            raise ValueError(f"dimension {spec.dim} of a {tuple(piece.shape)} tensor does not split evenly into "
                             f"{num_parts} parts")
        local.append(piece.narrow(spec.dim, part * length, length).contiguous())
    return torch.cat(local, dim=spec.dim).contiguous()


def join_slices(gathered: torch.Tensor, spec: SliceSpec, num_parts: int) -> torch.Tensor:
    """The logical tensor from every part concatenated along `spec.dim` in part order (the inverse
    of `cut_slice`): fused sub-tensors regrouped, padding dropped."""
    if spec.fused:
        per_part = gathered.chunk(num_parts, dim=spec.dim)
        local_sizes = [size // num_parts for size in spec.fused]
        columns = [piece.split(local_sizes, dim=spec.dim) for piece in per_part]
        gathered = torch.cat([torch.cat([c[i] for c in columns], dim=spec.dim) for i in range(len(spec.fused))],
                             dim=spec.dim)
    return gathered.narrow(spec.dim, 0, spec.logical_size)


@dataclasses.dataclass(frozen=True)
class ParamSlicing:
    """One parameter's slice: `spec` cut over `size` ranks, this rank holding part `rank`; the
    ranks lie along mesh axis `axis` (None when not said: then only the pure arithmetic serves)."""

    spec: SliceSpec
    local_shape: tuple[int, ...]
    rank: int
    size: int
    axis: str | None = None

    @classmethod
    def of(cls, placement: Placement, local_shape: tuple[int, ...], part: int, num_parts: int) -> ParamSlicing:
        local_shape = tuple(local_shape)
        return cls(SliceSpec.of(placement, local_shape, num_parts), local_shape, part, num_parts,
                   placement.slice_axis)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.spec.dim] = self.spec.logical_size
        return tuple(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logical tensor `full`."""
        return cut_slice(full, self.spec, self.rank, self.size)

    def gather(self, local: torch.Tensor, topology: Topology) -> torch.Tensor:
        """The logical tensor from every rank's `local` slice: an all-gather over `topology`'s
        group of the slice's axis (a collective: every rank of that group calls it)."""
        assert self.axis is not None and topology.size(self.axis) == self.size, (self.axis, self.size)
        local = local.detach().contiguous()
        flat = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        all_gather(flat, local.view(-1), group=topology.group(self.axis))
        return join_slices(torch.cat(flat.view(self.size, *local.shape).unbind(0), dim=self.spec.dim), self.spec,
                           self.size)

    def _logical_index_along_dim(self) -> torch.Tensor:
        """For each local index along the sliced dim, its logical index (-1: padding)."""
        local = self.local_shape[self.spec.dim]
        parts = self.spec.fused or (self.spec.padded_size or self.spec.logical_size,)
        mapping, base = [], 0
        for part in parts:
            per_rank = part // self.size
            mapping.append(torch.arange(per_rank, device="cpu") + base + self.rank * per_rank)
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
        flat = torch.arange(start, start + length, dtype=torch.int64, device="cpu")
        o, rest = flat // (local_dim * inner), flat % (local_dim * inner)
        j, i = rest // inner, rest % inner
        logical_j = self._logical_index_along_dim()[j]
        logical = (o * logical_dim + logical_j) * inner + i
        valid = logical_j >= 0
        # A run breaks where the logical index does not step by one, or validity changes.
        breaks = torch.ones(length, dtype=torch.bool, device="cpu")
        if length > 1:
            breaks[1:] = (logical[1:] != logical[:-1] + 1) | (valid[1:] != valid[:-1])
        starts = torch.nonzero(breaks).flatten().tolist() + [length]
        return [(int(logical[a]), b - a, a) for a, b in zip(starts[:-1], starts[1:]) if bool(valid[a])]


def param_slicings(module: torch.nn.Module, topology: Topology) -> dict[int, ParamSlicing]:
    """`id(param)` -> its slicing, for every parameter of `module` whose declared placement cuts
    it over a mesh axis of `topology` (this rank holding part `topology.axis_rank(axis)`)."""
    placements = parameter_placements(module)
    found = {}
    for param in module.parameters():
        axis = placements[id(param)].slice_axis
        if axis is not None:
            found[id(param)] = ParamSlicing.of(placements[id(param)], tuple(param.shape), topology.axis_rank(axis),
                                               topology.size(axis))
    return found
