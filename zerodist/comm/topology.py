"""The parallel topology: one validated, immutable object that hands out process groups.

The world is a mesh of five axes, outermost first: `pipe`, `data`, `expert`, `sequence`,
`tensor` (rank = (((pipe_index * data + data_index) * expert + expert_index) * sequence +
sequence_index) * tensor + tensor_index), Megatron's order. `tensor` is innermost so
tensor-parallel peers are neighbouring ranks, normally on one node, and `sequence` next to it
(its all-to-alls run in every attention layer); `pipe` is outermost, since a pipeline boundary
moves the fewest bytes and can cross nodes. An axis of degree 1 changes no rank's number.

Which group reduces what:
- non-expert parameters are replicated over `("data", "expert")`: their gradients are
  reduced (and ZeRO-sharded) over that group;
- an expert's parameters exist once per `("expert",)` group: their gradients are reduced over
  `("data",)` only (DeepSpeed's "expert-data-parallel" group);
- `("tensor",)` carries tensor-parallel all-reduces, `("sequence",)` the sequence-parallel
  all-to-alls, `("pipe",)` the point-to-point traffic between pipeline stages.
- sequence-parallel ranks hold the same parameters and read slices of the same samples, so
  gradients are reduced over `sequence` too; pipeline stages hold different parameters, so no
  parameter is replicated over `pipe` (`PARAMETER_AXES` leaves it out).

All groups are created when the Topology is built (or taken from an earlier Topology of the
same world), on every rank in the same order, so asking for a group later can never deadlock.
With `gradient_groups=True` every group of more than one rank gets a second group over the
same ranks, for gradient reductions only ([Note: gradient groups]). The arithmetic (degrees,
coordinates, partitions) is pure and tested without processes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from zerodist.comm import nodes
from zerodist.comm.collectives import Group, all_gather_object
from zerodist.comm.errors import TopologyError
from zerodist.comm.init import ensure_initialized

AXES = ("pipe", "data", "expert", "sequence", "tensor")
# The axes one batch is dealt over: tensor-parallel peers share a batch, expert-parallel ones do not.
# Sequence-parallel peers share the batch's samples and read a slice of each one's sequence.
BATCH_AXES = ("data", "expert")
# The axes a parameter can be replicated over: every axis but `pipe`, whose stages hold different
# layers. A domain's axes are drawn from these, so a stage's gradient norm counts its own
# parameters and the step's world-wide agreement sums the stages.
PARAMETER_AXES = ("data", "expert", "sequence", "tensor")




def resolve_degrees(world_size: int, *, data: int | None = None, expert: int = 1, tensor: int = 1, pipe: int = 1,
                    sequence: int = 1) -> dict[str, int]:
    """Degrees of every axis; `data=None` takes what the other axes leave of the world."""
    given = {"pipe": pipe, "data": data, "expert": expert, "sequence": sequence, "tensor": tensor}
    for axis, degree in given.items():
        if degree is not None and (not isinstance(degree, int) or isinstance(degree, bool) or degree < 1):
            raise TopologyError(f"{axis} degree must be a positive integer, got {degree!r}")
    # expert and tensor always named (the familiar two), pipe and sequence when asked for
    others = [(axis, degree) for axis, degree in given.items()
              if axis in ("expert", "tensor") or (axis != "data" and degree != 1)]
    others_text = " x ".join(f"{axis} ({degree})" for axis, degree in others)
    others_product = pipe * expert * sequence * tensor
    if data is None:
        if world_size % others_product:
            raise TopologyError(
                f"world size {world_size} is not divisible by {others_text} = {others_product}, "
                "so no data degree fits"
            )
        data = world_size // others_product
    product = data * others_product
    if product != world_size:
        raise TopologyError(
            f"data ({data}) x {others_text} = {product}, "
            f"but the world size is {world_size}; the degrees must multiply to the world size"
        )
    return {"pipe": pipe, "data": data, "expert": expert, "sequence": sequence, "tensor": tensor}


def coords_of(rank: int, degrees: Mapping[str, int]) -> dict[str, int]:
    """This rank's index along each axis (an axis missing from `degrees` has degree 1)."""
    coords = {}
    for axis in reversed(AXES):
        degree = degrees.get(axis, 1)
        coords[axis] = rank % degree
        rank //= degree
    return {axis: coords[axis] for axis in AXES}


def rank_of(coords: Mapping[str, int], degrees: Mapping[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * degrees.get(axis, 1) + coords.get(axis, 0)
    return rank


def axis_partition(degrees: Mapping[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """The world split into groups whose ranks differ only along `axes`, in rank order."""
    others = [a for a in AXES if a not in axes]
    groups = []
    for fixed in itertools.product(*(range(degrees.get(a, 1)) for a in others)):
        base = dict(zip(others, fixed))
        members = []
        for varying in itertools.product(*(range(degrees.get(a, 1)) for a in axes)):
            members.append(rank_of({**base, **dict(zip(axes, varying))}, degrees))
        groups.append(sorted(members))
    return sorted(groups)


# Groups made for earlier Topologies of the same world, reused by later ones: a gloo group holds
# threads and sockets until the world ends (9 descriptors and 6 threads per Topology with gradient
# groups, measured), and a program or test pool that initialises many engines would run out.
# Every rank builds the same Topologies in the same order (building one is collective), so every
# rank finds the same groups here and makes the same new ones.
_MADE: dict[tuple[Any, ...], Any] = {}
_MADE_FOR: list[Any] = [None]  # the world the groups in _MADE belong to


def _make_group(partition: list[list[int]], timeout: Any, backend: str, second: bool = False) -> Group:
    """This rank's group of `partition` (the world itself when it is one group), or with `second`
    a distinct group over the same ranks ([Note: gradient groups])."""
    if len(partition) == 1 and not second:
        return dist.group.WORLD
    if _MADE_FOR[0] is not dist.group.WORLD:  # a new world: the old groups died with the old one
        _MADE.clear()
        _MADE_FOR[0] = dist.group.WORLD
    key = (second, tuple(tuple(g) for g in partition), timeout, backend)
    if key not in _MADE:
        _MADE[key] = dist.new_subgroups_by_enumeration(partition, timeout=timeout, backend=backend)[0]
    return _MADE[key]


def split_partition(partition: list[list[int]], inner_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each group of `partition` cut into consecutive blocks of `inner_size` ranks (the inner
    groups), and the ranks at the same index of each block (the outer groups)."""
    inner, outer = [], []
    for members in partition:
        if len(members) % inner_size:
            raise TopologyError(f"a group of {len(members)} ranks cannot be split into blocks of {inner_size}")
        blocks = [members[i: i + inner_size] for i in range(0, len(members), inner_size)]
        inner += blocks
        outer += [sorted(block[j] for block in blocks) for j in range(inner_size)]
    return sorted(inner), sorted(outer)


@dataclasses.dataclass(frozen=True)
class Split:
    """A group over some axes cut in two levels (`Topology.split`): `inner` blocks of consecutive
    ranks (shard within), `outer` the ranks at this rank's index in every block (replicate across)."""

    inner: Group
    inner_grad: Group  # the same ranks as `inner`, for gradient reductions ([Note: gradient groups])
    inner_ranks: tuple[int, ...]
    outer: Group
    outer_ranks: tuple[int, ...]
    inner_link: str  # "intra" when every inner block lies within one node ([Note: link classes] in nodes.py)


def _canonical(axes: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise TopologyError(f"unknown axis {unknown or axes}; the axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in axes)


@dataclasses.dataclass(frozen=True)
class Domain:
    """Where a parameter lives on the mesh; see [Note: sharding domains].

    `reduce_axes`: its gradient is summed, and ZeRO shards it, over these axes.
    `replicated_axes`: the axes over which every rank holds the same values (a superset of
    `reduce_axes`). Over the axes replicated but not reduced (e.g. `tensor` for a LayerNorm
    weight next to tensor-parallel layers) every rank computes the same thing, so only the rank at
    index 0 of those axes counts the parameter in the global gradient norm.

    [Note: sharding domains] The gradient of every parameter is divided by the number of batch
    shards (`Topology.size(*BATCH_AXES)`), whatever its domain: an expert that receives tokens
    from all ranks of its expert group (all-to-all) already sums their contributions locally, so
    summing over `("data",)` and dividing by data x expert gives the one-process mean gradient.
    """

    reduce_axes: tuple[str, ...]
    replicated_axes: tuple[str, ...]

    def __post_init__(self) -> None:
        reduce_axes, replicated_axes = _canonical(self.reduce_axes), _canonical(self.replicated_axes)
        if "pipe" in replicated_axes:
            raise TopologyError("no parameter is replicated over the pipe axis: pipeline stages hold different "
                                f"layers (a domain's axes are drawn from {', '.join(PARAMETER_AXES)})")
        if not set(reduce_axes) <= set(replicated_axes):
            raise TopologyError(f"a domain reduces over {reduce_axes} but is replicated over {replicated_axes} "
                                "only; a gradient can be summed only where the parameter is replicated")
        object.__setattr__(self, "reduce_axes", reduce_axes)
        object.__setattr__(self, "replicated_axes", replicated_axes)

    @property
    def norm_axes(self) -> tuple[str, ...]:
        """Axes replicated but not reduced: only index 0 along them counts in the norm."""
        return tuple(a for a in self.replicated_axes if a not in self.reduce_axes)


# A dense parameter: replicated over every parameter axis, reduced over the batch axes and over
# `sequence` (whose ranks each saw a slice of every sample).
DENSE = Domain(BATCH_AXES + ("sequence",), PARAMETER_AXES)
# An expert's parameters: one copy per expert-parallel group (see zerodist/moe).
EXPERT = Domain(("data", "sequence"), ("data", "sequence", "tensor"))
# A tensor-parallel slice: each tensor rank holds a different slice (see zerodist/tensor_parallel).
TENSOR_SLICE = Domain(DENSE.reduce_axes, DENSE.reduce_axes)


class Topology:
    """Degrees of the parallel axes and their process groups. Build it on every rank.

    `Topology(data=None, expert=1, tensor=1, pipe=1, sequence=1)`: `data=None` means "the rest of
    the world". Ranks that ask for different degrees get a `TopologyError` naming each rank's request.
    """

    __slots__ = ("_degrees", "_coords", "_groups", "_gradient_groups", "_partitions", "rank", "world_size",
                 "_timeout", "_backend", "_splits")
    rank: int
    world_size: int
    _degrees: Mapping[str, int]
    _coords: Mapping[str, int]
    _groups: dict[tuple[str, ...], Group]
    _gradient_groups: dict[tuple[str, ...], Group]
    _partitions: dict[tuple[str, ...], list[list[int]]]
    _timeout: Any
    _backend: str
    _splits: dict[tuple[tuple[str, ...], int], Split]

    def __init__(self, *, data: int | None = None, expert: int = 1, tensor: int = 1, pipe: int = 1, sequence: int = 1,
                 group_timeout: Any = None, gradient_groups: bool = False):
        info = ensure_initialized()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        asked = {"pipe": pipe, "data": data, "expert": expert, "sequence": sequence, "tensor": tensor}
        requests: list[Any] = [None] * world_size
        all_gather_object(requests, tuple(asked.values()))
        if len(set(requests)) > 1:
            # data, expert and tensor always; pipe and sequence where some rank asked for them
            shown = [i for i, axis in enumerate(asked)
                     if axis in ("data", "expert", "tensor") or any(request[i] != 1 for request in requests)]
            listed = "; ".join(f"rank {r}: " + " ".join(f"{list(asked)[i]}={request[i]}" for i in shown)
                               for r, request in enumerate(requests))
            raise TopologyError(f"ranks asked for different topologies: {listed}")
        degrees = resolve_degrees(world_size, data=data, expert=expert, tensor=tensor, pipe=pipe, sequence=sequence)
        groups: dict[tuple[str, ...], Group] = {}
        partitions: dict[tuple[str, ...], list[list[int]]] = {}
        for count in range(1, len(AXES) + 1):
            for axes in itertools.combinations(AXES, count):
                partition = axis_partition(degrees, axes)
                groups[axes] = _make_group(partition, group_timeout, info.backend)  # one per distinct partition
                partitions[axes] = partition
        gradient: dict[tuple[str, ...], Group] = dict(groups)
        if gradient_groups:
            for axes, partition in partitions.items():  # the same order on every rank: the loop's above
                if len(partition[0]) > 1:
                    gradient[axes] = _make_group(partition, group_timeout, info.backend, second=True)
        for name, value in [
            ("rank", rank), ("world_size", world_size), ("_degrees", MappingProxyType(degrees)),
            ("_coords", MappingProxyType(coords_of(rank, degrees))), ("_groups", groups),
            ("_gradient_groups", gradient), ("_partitions", partitions),
            ("_timeout", group_timeout), ("_backend", info.backend), ("_splits", {}),
        ]:
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Topology is immutable; build a new one instead of setting {name!r}")

    @property
    def degrees(self) -> Mapping[str, int]:
        return self._degrees

    @property
    def coords(self) -> Mapping[str, int]:
        return self._coords

    def group(self, *axes: str) -> Group:
        """The process group of this rank over `axes` (e.g. `group("data", "expert")`)."""
        return self._groups[_canonical(axes)]

    def gradient_group(self, *axes: str) -> Group:
        """Where gradients reduced over `axes` are reduced: with `gradient_groups=True` a second
        process group over the same ranks as `group(*axes)` (the same group when it has one rank,
        or without `gradient_groups`).

        [Note: gradient groups] Collectives pair up across ranks by their order within one
        process group. ZeRO-3 issues parameter gathers from module hooks (autograd's order) and
        gradient reductions from the reducer (its own fixed order); on one group the two streams
        interleave, and ranks must agree on the interleaving, so each reduction would need an
        order check first, a round trip that also waits behind every gather queued ahead of it
        (on gloo one group's collectives run in issue order). On a group of their own the
        reductions are ordered among themselves only, need no check, and run beside the gathers.
        """
        return self._gradient_groups[_canonical(axes)]

    def size(self, *axes: str) -> int:
        """Number of ranks in this rank's group over `axes`."""
        size = 1
        for axis in _canonical(axes):
            size *= self._degrees[axis]
        return size

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks in this rank's group over `axes`, ascending."""
        for members in self._partitions[_canonical(axes)]:
            if self.rank in members:
                return list(members)
        raise AssertionError(f"rank {self.rank} missing from its own partition over {axes}")

    def axis_rank(self, *axes: str) -> int:
        """This rank's index within its group over `axes`."""
        return self.ranks(*axes).index(self.rank)

    def axis_rank_of(self, rank: int, *axes: str) -> int:
        """Global rank `rank`'s index within its own group over `axes`."""
        for members in self._partitions[_canonical(axes)]:
            if rank in members:
                return members.index(rank)
        raise TopologyError(f"rank {rank} is not in a world of {self.world_size}")

    # ------------------------------------------------------------------ nodes and two-level groups
    @property
    def ranks_per_node(self) -> int:
        """Consecutive ranks per node, from the launcher or a simulation (nodes.py)."""
        return nodes.ranks_per_node(self.world_size)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """The node this rank lives on."""
        return self.rank // self.ranks_per_node

    def split(self, axes: tuple[str, ...], inner_size: int) -> Split:
        """This rank's group over `axes` cut into blocks of `inner_size` consecutive ranks
        (MiCS / HSDP shard groups, hpZ's within-node groups) and the groups across the blocks.
        Collective the first time for given arguments: every rank must ask in the same order."""
        axes = _canonical(axes)
        key = (axes, inner_size)
        if key not in self._splits:
            inner, outer = split_partition(self._partitions[axes], inner_size)
            groups = (_make_group(inner, self._timeout, self._backend),
                      _make_group(inner, self._timeout, self._backend, second=True) if inner_size > 1
                      else _make_group(inner, self._timeout, self._backend),
                      _make_group(outer, self._timeout, self._backend, second=True))
            mine_in = next(tuple(g) for g in inner if self.rank in g)
            mine_out = next(tuple(g) for g in outer if self.rank in g)
            links = {nodes.link_of_ranks(g, self.world_size) for g in inner}
            self._splits[key] = Split(groups[0], groups[1], mine_in, groups[2], mine_out,
                                      nodes.INTER if nodes.INTER in links else nodes.INTRA)
        return self._splits[key]

    # ------------------------------------------------------------------ named groups
    # Code outside this module names groups by what they are for, never by spelling out axes.
    @property
    def dense_axes(self) -> tuple[str, ...]:
        """Where a dense parameter's gradient is reduced and ZeRO-sharded: `DENSE.reduce_axes`."""
        return DENSE.reduce_axes

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The axis experts are split over (expert parallelism's all-to-all runs here)."""
        return ("expert",)

    @property
    def expert_data_axes(self) -> tuple[str, ...]:
        """Where an expert's gradient is reduced: `EXPERT.reduce_axes` (DeepSpeed's expert-data group)."""
        return EXPERT.reduce_axes

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        """The axis tensor-parallel slices and their all-reduces run over."""
        return ("tensor",)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """The axis a sample's sequence is split over (sequence parallelism's all-to-alls)."""
        return ("sequence",)

    @property
    def pipe_axes(self) -> tuple[str, ...]:
        """The axis the model's layers are split over (pipeline stages' sends and receives)."""
        return ("pipe",)

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """Every axis but `pipe`: the ranks of one pipeline stage, which run the same units and steps
        (the whole mesh without a pipeline)."""
        return PARAMETER_AXES

    @property
    def world_group(self) -> Group:
        """Every rank of the mesh: the step's one all-reduce and the run-order checks."""
        return self._groups[AXES]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is dealt over (data loader, loss mean, gradient divisor)."""
        return BATCH_AXES

    @property
    def num_batch_shards(self) -> int:
        return self.size(*BATCH_AXES)

    @property
    def batch_rank(self) -> int:
        """Which batch shard this rank reads: tensor-parallel peers read the same one."""
        return self.axis_rank(*BATCH_AXES)

    def counts_in_norm(self, domain: Domain) -> bool:
        """Whether this rank adds a parameter of `domain` to the global gradient norm."""
        return all(self._coords[a] == 0 for a in domain.norm_axes)

    def __repr__(self) -> str:
        degrees = ", ".join(f"{a}={d}" for a, d in self._degrees.items())
        return f"Topology({degrees}; rank {self.rank} at {dict(self._coords)})"
