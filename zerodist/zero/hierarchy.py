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

[Note: composed axes] The shard and replica groups are cut from the domain's own group
(`Topology.split` over `domain.reduce_axes`), never from ranks counted by hand: with tensor
parallelism each tensor rank's data group is cut separately (a tensor-parallel slice and a
replicated parameter shard over the same ranks), with a pipeline each stage's, with sequence
parallelism the data x sequence group ZeRO already shards over. "Consecutive" means consecutive
in that group, so a shard group of S holds S / (sequence degree) data indices when S is a multiple
of it. hpZ's blocks are cut the same way. Expert parallelism is refused by name: an expert's
parameters shard over the expert-data group, a different group from the dense one, and one
shard size cannot cut both so that a group stays within a node.

Only the global gradient norm needs to know: each shard is held R times, so only replica index 0
counts its squares (`DomainGroup.counts_in_norm`).

`communication_data_type` (DeepSpeed's key, top level): the bucket is cast to that type before its
collective, divided in it, and cast back to the gradients' type (bucket.py): `fp32` reduces bf16
gradients in fp32. The default (null) reduces in the gradients' own type, as DeepSpeed does.
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist.comm import nodes
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
    replicate_degree: int | None = None  # zerodist.hsdp.replicate_degree: checked against the topology

    @classmethod
    def from_config(cls, config: Config) -> HierarchySettings:
        zero = config.zero_optimization
        dtype = None if config.communication_data_type is None else _COMM_DTYPES[config.communication_data_type]
        return cls(zero.mics_shard_size, zero.mics_hierarchical_params_gather, dtype,
                   zero.zero_hpz_partition_size if zero.stage == 3 else 1,
                   WEIGHT_BITS if zero.zero_quantized_weights else None,
                   GRADIENT_BITS if zero.zero_quantized_gradients else None,
                   None if config.zerodist.hsdp is None else config.zerodist.hsdp.replicate_degree)

    def shard_size_for(self, topology: Topology) -> int | None:
        """The shard group's size on this topology, or None for plain ZeRO (every rank of the dense
        group). Raises, naming the key and the fix, where it cannot apply: the same on every rank,
        before any of ZeRO's collectives ([Note: composed axes])."""
        within = " x ".join(f"{a} ({topology.size(a)})" for a in topology.dense_axes if topology.size(a) > 1)
        return shard_size_on(self, dense=topology.size(*topology.dense_axes),
                             expert=topology.size(*topology.expert_axes), within=within if " x " in within else "")


def shard_size_on(settings: HierarchySettings, *, dense: int, expert: int, within: str = "") -> int | None:
    """`HierarchySettings.shard_size_for` on bare degrees (`dense`: the ranks ZeRO shards a dense
    parameter over), so that `zerodist train` applies the engine's rules before it spawns a rank."""
    size = settings.shard_size
    if settings.replicate_degree is not None and size * settings.replicate_degree != dense:
        raise TopologyError(f"'zerodist.hsdp': shard_degree ({size}) x replicate_degree ({settings.replicate_degree}) "
                            f"must be the {dense} ranks ZeRO shards over (the data-parallel degree, times the "
                            "sequence degree with Ulysses); fix one of them, or drop replicate_degree")
    if size in (-1, dense):
        return None
    _refuse_experts(expert, "mics_shard_size", size)
    if size < 1 or dense % size:
        raise TopologyError(f"'zero_optimization.mics_shard_size' ({size}) must divide the data-parallel degree "
                            f"({dense}{': ' + within if within else ''}); choose one of "
                            f"{[d for d in range(1, dense + 1) if dense % d == 0]}")
    return size


def check_hpz_on(k: int, *, sharded: int, expert: int, pipe: int, ranks_per_node: int | None = None) -> None:
    """hpZ's refusals on bare degrees (`sharded`: the ranks a parameter is sharded over, the shard
    group's with MiCS): the engine's (`_hpz`) and `zerodist train`'s before it spawns."""
    _refuse_experts(expert, "zero_hpz_partition_size", k)
    if pipe > 1:
        raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) cannot be combined with pipeline "
                            f"parallelism (pipe degree {pipe}): a pipeline gathers each "
                            "stage once per batch and keeps it to the stage's last backward, so there is no backward "
                            "re-gather for hpZ's copy to serve, only its memory to pay; remove zero_hpz_partition_size "
                            "(mics_shard_size keeps a stage's gathers within the node)")
    if sharded > 1 and sharded % k:
        per_node = f"the ranks per node ({ranks_per_node})" if ranks_per_node else "the ranks per node"
        raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) must divide the {sharded} ranks "
                            "parameters are sharded over (the data-parallel degree, or mics_shard_size); set it to "
                            f"{per_node} where that divides them")


def _refuse_experts(expert: int, key: str, value: int) -> None:
    """MiCS and hpZ with expert parallelism: refused by name ([Note: composed axes])."""
    if expert > 1:
        raise TopologyError(f"'zero_optimization.{key}' ({value}) cannot be combined with expert parallelism "
                            f"(expert degree {expert}): an expert's parameters shard over "
                            "the smaller expert-data group, which the shard groups would have to cut differently from "
                            f"the dense ones; remove {key} or the expert degree")


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
    """qgZ over the shard group: intra-node then inter-node when it is the whole group of its domain
    and spans several nodes with several of its ranks on each, else one hop."""
    members = group_ranks_per_node(plain.ranks, topology.world_size)
    hierarchical = plain.replica_group is None and 1 < members < plain.size
    if not hierarchical:
        return QuantizedReduction(bits, plain.grad_group)
    split = topology.split(domain.reduce_axes, members)
    return QuantizedReduction(bits, split.inner_grad, split.outer)


def group_ranks_per_node(ranks: tuple[int, ...] | list[int], world_size: int) -> int:
    """How many of a group's (ascending) ranks share each node, where every node it touches holds the
    same number of them in one consecutive run of the group (else 1: no two-level split)."""
    per_node = nodes.ranks_per_node(world_size)
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // per_node] = counts.get(r // per_node, 0) + 1
    sizes = set(counts.values())
    return sizes.pop() if len(sizes) == 1 else 1


def _hpz(topology: Topology, domain: Domain, k: int, plain: DomainGroup) -> DomainGroup:
    """hpZ's secondary groups: blocks of k consecutive ranks of the (shard) group ([Note: secondary partition])."""
    check_hpz_on(k, sharded=plain.size, expert=topology.size(*topology.expert_axes),
                 pipe=topology.size(*topology.pipe_axes), ranks_per_node=topology.ranks_per_node)
    if plain.size == 1:
        return plain  # one rank: nothing is gathered
    if k == plain.size:
        return plain  # the secondary would be the primary partition
    split = topology.split(domain.reduce_axes, k)
    return dataclasses.replace(plain, secondary=SecondaryGroup(split.inner, split.inner_ranks.index(topology.rank), k))


def _mics(topology: Topology, domain: Domain, settings: HierarchySettings, plain: DomainGroup,
          size: int) -> DomainGroup:
    assert topology.size(*domain.reduce_axes) == topology.size(*DENSE.reduce_axes), f"MiCS over a {domain} group"
    split = topology.split(domain.reduce_axes, size)
    if settings.hierarchical_gather and split.inner_link == "inter":
        raise TopologyError(f"'zero_optimization.mics_hierarchical_params_gather' is true but a shard group of "
                            f"{size} ranks spans nodes of {topology.ranks_per_node}; zerodist gathers within a shard "
                            "group in one step: set mics_shard_size to a divisor of the ranks per node, or the key "
                            "to false")
    ranks = split.inner_ranks
    # a rank's index in its own shard group: blocks are consecutive in its (sorted) group over the axes
    index_of = tuple(topology.axis_rank_of(r, *domain.reduce_axes) % size for r in range(topology.world_size))
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
