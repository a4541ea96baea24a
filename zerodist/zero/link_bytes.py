"""docs/design/zero.md's bytes per link class, per step, for the groups an engine built: what the
tracer's `bus_bytes_by_link()` must show ([Note: link classes] in zerodist/comm/nodes.py).

Per bucket of N = D x S elements over a shard group of D ranks (b bytes per element, b_c in the
communication data type, q_k(S) the bytes of S elements block-quantized to k bits):
- each parameter gather: N b (D-1)/D, with qwZ D q_8(S) (D-1)/D, on the shard group's link;
  with hpZ a backward re-gather is N b (k-1)/k within the block of k instead;
- each gradient reduction: N b_c (D-1)/D on the shard group's link; with qgZ over L ranks per
  node and M = D / L nodes D q_4(S) (L-1)/L intra, then M q_4(S) (M-1)/M inter (one hop over D:
  D q_4(S) (D-1)/D); with MiCS the reduced shard is then all-reduced over the R = D_data / D
  replicas: S b_c 2(R-1)/R on their link.
Stage 3's unit groups gather once in forward and once more in backward unless the unit is kept
gathered in between (`stage3_max_reuse_distance`), every micro-step; its persistent groups, like
stages 1-2, gather once after the step. Under a pipeline a stage is gathered once per batch and
kept to its last backward, and its gradients are reduced once ([Note: pipeline under ZeRO] in
zerodist/engine/pipeline.py): one pass, no re-gather (`step_link_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zerodist.comm import nodes
from zerodist.comm.quantize import quantized_nbytes
from zerodist.comm.topology import Topology
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.hierarchy import group_ranks_per_node
from zerodist.zero.runtime import UnitRuntime

QUANT_BLOCK = 256  # zerodist.comm.quantize.DEFAULT_BLOCK: the block ZeRO++'s collectives use


def link_bus_bytes(groups: Iterable[FlatParamGroup], topology: Topology, *, regathered: set[int],
                   micro_steps: int = 1) -> dict[str, float]:
    """Bus bytes per link class one step moves on this rank. `regathered`: ids of the sharded groups
    gathered again in backward; `micro_steps`: forward-backward passes per step."""
    out = {nodes.INTRA: 0.0, nodes.INTER: 0.0}
    for group in groups:
        dg = group.domain_group
        d, link = dg.size, nodes.link_of_ranks(list(dg.ranks), topology.world_size)
        b = group.param_dtype.itemsize
        b_c = dg.grad_comm_dtype.itemsize if dg.grad_comm_dtype is not None else b
        sharded, again = group.policy.shard_parameters, id(group) in regathered
        gathers = micro_steps if sharded else int(group.policy.shard_optimizer_state)  # forward / after the step
        syncs = micro_steps if group.policy.shard_gradients else 1
        replicas = topology.size(*dg.domain.reduce_axes) // d
        replica_link = (nodes.link_of_ranks(list(topology.split(dg.domain.reduce_axes, d).outer_ranks),
                                            topology.world_size) if replicas > 1 else link)
        for span in group.layout.buckets:
            s, n = span.shard_numel, span.numel
            if d == 1:
                continue
            gather = d * quantized_nbytes(s, dg.weight_bits, QUANT_BLOCK) if dg.weight_bits and sharded else n * b
            out[link] += gather * (d - 1) / d * gathers
            if sharded and again and dg.secondary is not None:  # hpZ: the backward's gather within the block
                k = dg.secondary.size
                block = dg.ranks[dg.rank // k * k: dg.rank // k * k + k]  # this rank's block of k in its group
                block_link = nodes.link_of_ranks(list(block), topology.world_size)
                out[block_link] += n * b * (k - 1) / k * micro_steps
            elif sharded and again:
                out[link] += gather * (d - 1) / d * micro_steps
            _gradient(out, group, d, s, n * b_c, link, topology, syncs)
            if replicas > 1:  # MiCS: the reduced shard over the replicas
                out[replica_link] += s * b_c * 2 * (replicas - 1) / replicas * syncs
    return out


def _gradient(out: dict[str, float], group: FlatParamGroup, d: int, s: int, full_bytes: float, link: str,
              topology: Topology, syncs: int) -> None:
    """One bucket's gradient reduction within the shard group, `syncs` times."""
    quantized = group.domain_group.quantized_grads
    if not group.plan.use_reduce_scatter:  # all-reduce
        out[link] += full_bytes * 2 * (d - 1) / d * syncs
        return
    if quantized is None:
        out[link] += full_bytes * (d - 1) / d * syncs
        return
    chunk = quantized_nbytes(s, quantized.bits, QUANT_BLOCK)
    if quantized.inter_group is None:
        out[link] += d * chunk * (d - 1) / d * syncs
        return
    per_node = group_ranks_per_node(group.domain_group.ranks, topology.world_size)
    hosts = d // per_node
    out[nodes.INTRA] += d * chunk * (per_node - 1) / per_node * syncs
    out[nodes.INTER] += hosts * chunk * (hosts - 1) / hosts * syncs


def step_link_bytes(engine: Any) -> dict[str, float]:
    """`link_bus_bytes` for one optimizer step of an engine: its micro-steps and re-gathered units,
    or under a pipeline one gather and one reduction per stage and batch (without `max_active_stages`)."""
    if engine.pipeline is not None:
        return link_bus_bytes(engine.groups, engine.topology, regathered=set(), micro_steps=1)
    return link_bus_bytes(engine.groups, engine.topology, regathered=regathered_groups(engine.stage3),
                          micro_steps=engine.gradient_accumulation_steps())


def regathered_groups(runtime: UnitRuntime | None) -> set[int]:
    """Ids of the flat groups stage 3 gathers again in backward: every unit but the root and those
    kept gathered from forward to backward (`UnitRuntime.kept`)."""
    if runtime is None:
        return set()
    return {id(g) for unit in runtime.order if unit.index not in runtime.kept for g in unit.groups}
