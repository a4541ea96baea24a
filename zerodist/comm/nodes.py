"""Which node (machine) each rank lives on, and which link class a process group's traffic crosses.

The launcher says how many ranks share a machine: torchrun sets `LOCAL_WORLD_SIZE` on every rank,
and ranks are numbered node by node (rank = node * local_world_size + local_rank), so rank r
lives on node r // ranks_per_node. One machine can stand for K nodes (tests, `zerodist train
--nnodes-sim K`, the benchmarks): `ZERODIST_SIMULATED_NODES=K` in the environment, or
`zerodist.simulated_nodes: K` in the config (the engine calls `simulate_nodes(K)` before it
builds anything), splits the world into K nodes of world_size / K consecutive ranks.

[Note: link classes] A collective whose group lies within one node is `intra`; one whose group
spans nodes is `inter`. The tracer files every collective's bytes under its group's class: on a
ring (or any bandwidth-optimal algorithm) over a group that spans nodes every rank's share crosses
the slowest link at the same rate, which is what bounds the step; this is the convention of
DeepSpeed's ZeRO++ paper, whose "cross-node volume" of plain ZeRO-3 is the whole 3Ψ.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from zerodist.comm.errors import TopologyError

INTRA, INTER = "intra", "inter"
ENV_SIMULATED = "ZERODIST_SIMULATED_NODES"

_simulated: list[int | None] = [None]  # set by simulate_nodes(); wins over the environment
_link_cache: dict[tuple[int, int], str] = {}  # (id(group), ranks per node) -> link class


def simulate_nodes(count: int | None) -> None:
    """Let one machine stand for `count` nodes (None: back to the launcher's / the environment's)."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise TopologyError(f"simulated nodes must be a positive integer, got {count!r}")
    _simulated[0] = count
    _link_cache.clear()


def _count_from_env() -> int | None:
    text = os.environ.get(ENV_SIMULATED)
    if not text:
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise TopologyError(f"{ENV_SIMULATED}={text!r}: give a positive number of nodes")
    return count


def ranks_per_node(world_size: int) -> int:
    """How many consecutive ranks share a node (the whole world when the launcher says nothing)."""
    count = _simulated[0] if _simulated[0] is not None else _count_from_env()
    if count is not None:
        if world_size % count:
            raise TopologyError(f"{count} simulated nodes do not divide the world of {world_size} ranks; "
                                f"set {ENV_SIMULATED} (or zerodist.simulated_nodes) to a divisor of {world_size}")
        return world_size // count
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) >= 1 and world_size % int(local) == 0:
        return int(local)
    return world_size


def num_nodes(world_size: int) -> int:
    return world_size // ranks_per_node(world_size)


def node_of(rank: int, world_size: int) -> int:
    return rank // ranks_per_node(world_size)


def link_of_ranks(ranks: list[int], world_size: int) -> str:
    """`intra` when every rank of `ranks` is on one node, else `inter` ([Note: link classes])."""
    per_node = ranks_per_node(world_size)
    return INTRA if len({r // per_node for r in ranks}) <= 1 else INTER


def link_of_group(group: Any) -> str:
    """The link class of a process group (None: the world). Cached per group."""
    world_size = dist.get_world_size()
    key = (id(group), ranks_per_node(world_size))
    link = _link_cache.get(key)
    if link is None:
        ranks = list(range(world_size)) if group is None else dist.get_process_group_ranks(group)
        link = _link_cache[key] = link_of_ranks(ranks, world_size)
    return link
