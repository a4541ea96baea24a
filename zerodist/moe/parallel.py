"""Expert parallelism for a whole model: the degree its MoE layers ask for, and wiring them to a
topology. `zerodist.initialize` calls these; a script that uses MoE layers without the engine
can too.

    degree = zerodist.comm.domains.expert_parallel_degree(model)   # the layers declare their ep_size
    topology = Topology(expert=degree)
    apply_expert_parallel(model, topology, seed=config_seed)
    ...
    set_routing_step(model, step)                 # before each optimizer step's forwards
"""

from __future__ import annotations

import torch

from zerodist import comm
from zerodist.moe.state import moe_layers


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


class RoutingClock:
    """Keys the random routing of a model's MoE layers by optimizer step without touching the
    engine: a forward pre-hook on the root module counts training forwards, and forward n runs
    as (step = n // gradient_accumulation_steps, call = n % gradient_accumulation_steps), the
    key a one-process reference sets with `MoE.set_routing_key(step=...)` before each micro-batch.
    Eval forwards do not advance it. `state_dict()` holds the count, for resuming."""

    def __init__(self, model: torch.nn.Module, gradient_accumulation_steps: int) -> None:
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.forwards = 0
        self._handle = model.register_forward_pre_hook(self._before_forward)
        self._model_layers = [layer for _, layer in moe_layers(model)]

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if not module.training:
            return
        step, call = divmod(self.forwards, self.gradient_accumulation_steps)
        for layer in self._model_layers:
            layer.set_routing_key(step=step)
            layer.deepspeed_moe.gate.routing_key.call = call
        self.forwards += 1

    def state_dict(self) -> dict[str, int]:
        return {"forwards": self.forwards}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.forwards = int(state["forwards"])

    def remove(self) -> None:
        self._handle.remove()
