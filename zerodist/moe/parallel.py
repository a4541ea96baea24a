"""Expert parallelism for a whole model: the degree its MoE layers ask for, and wiring them to a
topology. `zerodist.initialize` calls these; a script that uses MoE layers without the engine
can too.

    degree = expert_parallel_degree(model)        # before building the Topology
    topology = Topology(expert=degree)
    apply_expert_parallel(model, topology, seed=config_seed)
    ...
    set_routing_step(model, step)                 # before each optimizer step's forwards
"""

from __future__ import annotations

import torch

from zerodist import comm
from zerodist.moe.state import moe_layers


class ExpertParallelError(ValueError):
    """The MoE layers of one model ask for incompatible expert-parallel layouts."""


def expert_parallel_degree(model: torch.nn.Module) -> int:
    """The `ep_size` every MoE layer of `model` shares (1 without MoE layers). Layers that ask for
    different sizes are an error naming them: they would need different expert groups, and all
    expert groups of zerodist's mesh are one axis."""
    by_size: dict[int, list[str]] = {}
    for name, layer in moe_layers(model):
        by_size.setdefault(layer.ep_size, []).append(name or "<root>")
    if len(by_size) > 1:
        listed = "; ".join(f"ep_size={size}: {', '.join(names)}" for size, names in sorted(by_size.items()))
        raise ExpertParallelError(f"the MoE layers of one model must share one ep_size, got {listed}")
    return next(iter(by_size), 1)


def apply_expert_parallel(model: torch.nn.Module, topology: comm.Topology, *, seed: int = 0) -> int:
    """Give every MoE layer of `model` `topology`'s expert group and its routing key (seed, layer
    index in model order, batch shard = `topology.batch_rank`). Returns the number of layers."""
    layers = moe_layers(model)
    for index, (_, layer) in enumerate(layers):
        layer.set_topology(topology)
        layer.set_routing_key(seed=seed, layer=index, step=0)
    return len(layers)


def set_routing_step(model: torch.nn.Module, step: int) -> None:
    """Key the random routing of every MoE layer by optimizer step `step` (restarting the per-step
    forward count), so micro-batches route the same way at any expert-parallel size."""
    for _, layer in moe_layers(model):
        layer.set_routing_key(step=step)
