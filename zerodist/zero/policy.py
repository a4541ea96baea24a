"""What ZeRO shards (the policy) and over which ranks (a flat group's domain group).

A ZeRO stage is a choice of what is sharded (docs/design/zero.md's table); `ShardingPolicy` states that
choice once, frozen, and every component reads it instead of comparing stage numbers:

    stage   optimizer state   gradients   parameters
      0          full            full        full
      1        sharded           full        full
      2        sharded         sharded       full
      3        sharded         sharded     sharded   (persistent groups: parameters full)

`DomainGroup` is where one flat group reduces and shards: its domain's process group (over
the domain's reduce axes; its gradient reductions may use a second group over the same ranks),
this rank's index and the group's size, plus what the step needs to know about the domain: the
gradient divisor (the number of batch shards, for every domain: [Note: sharding domains] in
zerodist/comm/topology.py) and whether this rank counts the group in the global gradient norm.
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist.comm import Group
from zerodist.comm.topology import Domain, Topology


@dataclasses.dataclass(frozen=True)
class ShardingPolicy:
    """Which of a flat group's model states are sharded over its domain group."""

    shard_optimizer_state: bool
    shard_gradients: bool
    shard_parameters: bool
    # Stage 3: groups of parameters under the persistence threshold keep full parameters (and
    # sharded gradients and optimizer state): they are small and used by every unit.
    persistent_full_parameters: bool = True

    def __post_init__(self) -> None:
        if self.shard_parameters and not self.shard_gradients:
            raise ValueError("sharded parameters need sharded gradients (each rank steps only its own shard)")
        if self.shard_gradients and not self.shard_optimizer_state:
            raise ValueError("sharded gradients need sharded optimizer state (a rank steps only the shard it reduced)")

    @classmethod
    def from_stage(cls, stage: int) -> ShardingPolicy:
        """The policy of DeepSpeed's ZeRO `stage` (0-3). The only place a stage number is compared."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(shard_optimizer_state=stage >= 1, shard_gradients=stage >= 2, shard_parameters=stage >= 3)

    @property
    def stage(self) -> int:
        """The ZeRO stage this policy is, for reports and formulas (never for decisions)."""
        return int(self.shard_optimizer_state) + int(self.shard_gradients) + int(self.shard_parameters)

    def for_persistent(self) -> ShardingPolicy:
        """The policy of a persistent group (parameters under the stage-3 persistence threshold)."""
        if not self.persistent_full_parameters:
            return self
        return dataclasses.replace(self, shard_parameters=False)


@dataclasses.dataclass(frozen=True)
class SecondaryGroup:
    """hpZ: the block of k ranks a secondary copy of the parameters is sharded over, and this rank's
    index in it ([Note: secondary partition] in hpz.py)."""

    group: Group
    index: int
    size: int


@dataclasses.dataclass(frozen=True)
class QuantizedReduction:
    """qgZ: gradients reduce-scattered by quantized all-to-all over `group` (within the node), then
    `inter_group` (across nodes; None: one hop over `group`), zerodist/comm/quantized.py."""

    bits: int
    group: Group
    inter_group: Group = None


@dataclasses.dataclass(frozen=True)
class DomainGroup:
    """The ranks one flat group reduces and shards over: its domain's group on this rank."""

    domain: Domain
    group: Group  # the process group over domain.reduce_axes
    rank: int  # this rank's index in `group`
    size: int
    ranks: tuple[int, ...]  # global ranks of `group`, ascending (index = rank in the group)
    grad_divisor: int  # the number of batch shards, whatever the domain
    counts_in_norm: bool  # this rank adds the group's owned squares to the global norm
    # global rank -> its index in its own group over the same axes: a rank of another group of the
    # domain stands for the member of this one at that index (same coordinates on the reduce axes)
    index_of: tuple[int, ...]
    coords: dict[str, int]  # this rank's index along each mesh axis (which slice of a sliced tensor it holds)
    degrees: dict[str, int]
    # where the buckets reduce gradients: `group`, or a second group over the same ranks when the
    # Topology was built with gradient groups (stage 3: [Note: gradient groups] in comm/topology.py)
    grad_group: Group = None
    # Hierarchical sharding (MiCS / HSDP, hierarchy.py): the ranks holding the same shard in the other
    # shard groups, over which the reduced shard is all-reduced; None: `group` is the whole domain.
    replica_group: Group = None
    grad_comm_dtype: torch.dtype | None = None  # communication_data_type; None: the gradients' own
    secondary: SecondaryGroup | None = None  # hpZ (zero_hpz_partition_size > 1): where sharded groups keep a copy
    weight_bits: int | None = None  # qwZ: sharded groups gather their parameters quantized to this many bits
    quantized_grads: QuantizedReduction | None = None  # qgZ

    def __post_init__(self) -> None:
        if self.grad_group is None:
            object.__setattr__(self, "grad_group", self.group)

    @classmethod
    def of(cls, topology: Topology, domain: Domain) -> DomainGroup:
        axes = domain.reduce_axes
        index_of = tuple(topology.axis_rank_of(rank, *axes) for rank in range(topology.world_size))
        return cls(domain, topology.group(*axes), topology.axis_rank(*axes), topology.size(*axes),
                   tuple(topology.ranks(*axes)), topology.num_batch_shards, topology.counts_in_norm(domain), index_of,
                   dict(topology.coords), dict(topology.degrees), topology.gradient_group(*axes))

    def peer_of(self, global_rank: int) -> int:
        """The global rank of this group's member that stands where `global_rank` stands in its own."""
        return self.ranks[self.index_of[global_rank]]
