"""Past one machine: hierarchical sharding (MiCS / HSDP) and the gradient reduction's data type.

[Note: hierarchical sharding] With `zero_optimization.mics_shard_size: S` (DeepSpeed's MiCS; FSDP2
calls it HSDP) the D data-parallel ranks form D / S shard groups of S consecutive ranks. Every
flat group is laid out, sharded and gathered over its shard group only (parameters, gradients and
optimizer state are split S ways, and replicated D / S times); a gradient bucket is
reduce-scattered within the shard group, and the reduced shard is then all-reduced over the
replica group (the ranks at the same index of every shard group), then divided by D as before.
With S = ranks per node, every parameter all-gather and every reduce-scatter stays within a
node, and only the shard's all-reduce (2Ψ/S (R-1)/R per rank, R = D / S replicas) crosses nodes:
docs/design/zero.md gives the bytes per link class. The sum is (within the group) then (across
groups), a different order from one reduce-scatter over D: the result agrees with plain ZeRO to
rounding (1e-6 of one process, tests/zero/test_mics.py), not bitwise.

Only the global gradient norm needs to know: each shard is held R times, so only replica index 0
counts its squares (`DomainGroup.counts_in_norm`).

`communication_data_type` (DeepSpeed's key, top level): the bucket is cast to that type before its
collective, divided in it, and cast back to the gradients' type (bucket.py): `fp32` reduces bf16
gradients in fp32. The default (null) reduces in the gradients' own type, as DeepSpeed does.
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist.comm.errors import TopologyError
from zerodist.comm.topology import DENSE, Domain, Topology
from zerodist.config import Config
from zerodist.zero.policy import DomainGroup, QuantizedReduction, SecondaryGroup

# ZeRO++'s formats (DeepSpeed's and its paper's): int8 weights, int4 gradients, blocks of 256 with an fp32 scale.
WEIGHT_BITS, GRADIENT_BITS = 8, 4
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class HierarchySettings:
    """What hierarchical sharding and the reduction's data type take from the config."""

    shard_size: int = -1  # zero_optimization.mics_shard_size; -1: every data-parallel rank
    hierarchical_gather: bool = False  # zero_optimization.mics_hierarchical_params_gather
    grad_comm_dtype: torch.dtype | None = None  # communication_data_type
    hpz_size: int = 1  # zero_optimization.zero_hpz_partition_size (stage 3 only)
    weight_bits: int | None = None  # zero_quantized_weights: int8 (qwZ)
    grad_bits: int | None = None  # zero_quantized_gradients: int4 (qgZ)

    @classmethod
    def from_config(cls, config: Config) -> HierarchySettings:
        zero = config.zero_optimization
        dtype = None if config.communication_data_type is None else _COMM_DTYPES[config.communication_data_type]
        return cls(zero.mics_shard_size, zero.mics_hierarchical_params_gather, dtype,
                   zero.zero_hpz_partition_size if zero.stage == 3 else 1,
                   WEIGHT_BITS if zero.zero_quantized_weights else None,
                   GRADIENT_BITS if zero.zero_quantized_gradients else None)

    def shard_size_for(self, topology: Topology) -> int | None:
        """The shard group's size on this topology, or None for plain ZeRO (every data rank).
        Raises, naming the key and the fix, where it cannot apply: the same on every rank, before
        any of ZeRO's collectives."""
        size = self.shard_size
        data = topology.size(*topology.dense_axes)
        if size in (-1, data):
            return None
        others = {axis: d for axis, d in topology.degrees.items() if axis != "data" and d > 1}
        if others:
            raise TopologyError(f"'zero_optimization.mics_shard_size' ({size}) shards over data-parallel ranks only; "
                                f"it cannot be combined with {', '.join(f'{a} ({d})' for a, d in others.items())}: "
                                "remove mics_shard_size or those degrees")
        if size < 1 or data % size:
            raise TopologyError(f"'zero_optimization.mics_shard_size' ({size}) must divide the data-parallel degree "
                                f"({data}); choose one of {[d for d in range(1, data + 1) if data % d == 0]}")
        return size


def domain_group(topology: Topology, domain: Domain, settings: HierarchySettings) -> DomainGroup:
    """The ranks a flat group of `domain` shards and reduces over: its domain's group, or with
    hierarchical sharding its shard group plus the replica group ([Note: hierarchical sharding])."""
    plain = DomainGroup.of(topology, domain)
    plain = dataclasses.replace(plain, grad_comm_dtype=settings.grad_comm_dtype)
    size = settings.shard_size_for(topology)
    if size is not None:
        plain = _mics(topology, domain, settings, plain, size)
    if settings.hpz_size > 1:
        plain = _hpz(topology, domain, settings.hpz_size, plain)
    if settings.weight_bits is not None and plain.size > 1:
        plain = dataclasses.replace(plain, weight_bits=settings.weight_bits)
    if settings.grad_bits is not None and plain.size > 1:
        plain = dataclasses.replace(plain, quantized_grads=_qgz(topology, domain, settings.grad_bits, plain))
    return plain


def _qgz(topology: Topology, domain: Domain, bits: int, plain: DomainGroup) -> QuantizedReduction:
    """qgZ over the shard group: intra-node then inter-node when it is the whole data-parallel group of
    a data-only topology spanning several nodes of several ranks each, else one hop."""
    per_node, data = topology.ranks_per_node, topology.size(*domain.reduce_axes)
    hierarchical = (plain.replica_group is None and data == topology.world_size and 1 < per_node < data
                    and data % per_node == 0)
    if not hierarchical:
        return QuantizedReduction(bits, plain.grad_group)
    split = topology.split(domain.reduce_axes, per_node)
    return QuantizedReduction(bits, split.inner_grad, split.outer)


def _hpz(topology: Topology, domain: Domain, k: int, plain: DomainGroup) -> DomainGroup:
    """hpZ's secondary groups: blocks of k consecutive ranks of the (shard) group ([Note: secondary partition])."""
    others = {axis: d for axis, d in topology.degrees.items() if axis != "data" and d > 1}
    if others:
        raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) builds its groups over data-parallel "
                            f"ranks only; it cannot be combined with {', '.join(f'{a} ({d})' for a, d in others.items())}: "
                            "remove zero_hpz_partition_size or those degrees")
    if plain.size == 1:
        return plain  # one rank: nothing is gathered
    if plain.size % k:
        raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) must divide the {plain.size} ranks "
                            "parameters are sharded over (the data-parallel degree, or mics_shard_size); set it to the "
                            f"ranks per node ({topology.ranks_per_node}) where that divides them")
    if k == plain.size:
        return plain  # the secondary would be the primary partition
    split = topology.split(domain.reduce_axes, k)
    return dataclasses.replace(plain, secondary=SecondaryGroup(split.inner, split.inner_ranks.index(topology.rank), k))


def _mics(topology: Topology, domain: Domain, settings: HierarchySettings, plain: DomainGroup,
          size: int) -> DomainGroup:
    assert domain == DENSE, f"hierarchical sharding of a {domain} group"
    split = topology.split(domain.reduce_axes, size)
    if settings.hierarchical_gather and split.inner_link == "inter":
        raise TopologyError(f"'zero_optimization.mics_hierarchical_params_gather' is true but a shard group of "
                            f"{size} ranks spans nodes of {topology.ranks_per_node}; zerodist gathers within a shard "
                            "group in one step: set mics_shard_size to a divisor of the ranks per node, or the key "
                            "to false")
    ranks = split.inner_ranks
    index_of = tuple(r % size for r in range(topology.world_size))  # data is the only axis: blocks are consecutive
    return dataclasses.replace(
        plain, group=split.inner, rank=ranks.index(topology.rank), size=size, ranks=ranks, index_of=index_of,
        grad_group=split.inner_grad, replica_group=split.outer,
        counts_in_norm=plain.counts_in_norm and split.outer_ranks[0] == topology.rank)


def describe_links(topology: Topology, group: DomainGroup) -> list[str]:
    """The start-up report's line on nodes and the past-one-machine modes (none on one node with none on)."""
    modes = []
    if group.replica_group is not None:
        modes.append(f"MiCS shard groups of {group.size}, all-reduced over {topology.size(*group.domain.reduce_axes) // group.size} replicas")
    if group.secondary is not None:
        modes.append(f"hpZ secondary copies over blocks of {group.secondary.size}")
    if group.weight_bits is not None:
        modes.append(f"qwZ int{group.weight_bits} gathers")
    if group.quantized_grads is not None:
        hops = "intra then inter node" if group.quantized_grads.inter_group is not None else "one hop"
        modes.append(f"qgZ int{group.quantized_grads.bits} gradients ({hops})")
    if group.grad_comm_dtype is not None:
        modes.append(f"gradients reduced in {str(group.grad_comm_dtype).removeprefix('torch.')}")
    if topology.num_nodes == 1 and not modes:
        return []
    return [f"{topology.num_nodes} node(s) of {topology.ranks_per_node} rank(s)"
            + (": " + "; ".join(modes) if modes else "")]
