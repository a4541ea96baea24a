"""Expert parallelism for a whole model: the degree its MoE layers ask for, and wiring them to a
topology. `zerodist.initialize` calls these; a script that uses MoE layers without the engine
can too.

    degree = zerodist.comm.domains.expert_parallel_degree(model)   # the layers declare their ep_size
    topology = Topology(expert=degree)
    apply_expert_parallel(model, topology, seed=config_seed)
    RoutingClock(model, gradient_accumulation_steps, topology)   # keys random routing by micro-batch
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from zerodist import comm
from zerodist.moe.experts import expert_containers
from zerodist.moe.ordered import ExpertOrder, set_expert_order
from zerodist.moe.state import gather_global_state_dict, localize_state_dict, moe_layers


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
    """Keys the random routing of a model's MoE layers by position in the run, without touching
    the engine: a forward pre-hook on the root module counts training forwards, and forward n
    (micro-step m = n % accumulation of optimizer step n // accumulation) routes with the key
    (step, shard = m * num_batch_shards + batch_rank): the index of its micro-batch within the
    global batch, which is the same at every data and expert-parallel size. A one-process
    reference sets that key with `MoE.set_routing_key(shard=..., step=...)` before each
    micro-batch. Eval forwards do not advance it; a checkpoint load restores the count
    (`restore_routing_clock`). After each step's last forward it runs the aux-loss-free
    balancing update of the layers that have it (`MoE.update_expert_bias`)."""

    def __init__(self, model: torch.nn.Module, gradient_accumulation_steps: int, topology: comm.Topology,
                 micro_batch_index: Callable[[int, int], int] | None = None) -> None:
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.num_batch_shards, self.batch_rank = topology.num_batch_shards, topology.batch_rank
        # the layout-invariant mode's dealing (batch rank, micro-step) -> micro-batch k; else interleaved
        self.micro_batch_index = micro_batch_index or (lambda rank, micro: micro * self.num_batch_shards + rank)
        self.forwards = 0
        self._layers = [layer for _, layer in moe_layers(model)]
        self._handles = [model.register_forward_pre_hook(self._before_forward),
                         model.register_forward_hook(self._after_forward)]
        _CLOCKS[model] = self

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if not module.training:
            return
        step, micro = divmod(self.forwards, self.gradient_accumulation_steps)
        for layer in self._layers:
            layer.set_routing_key(step=step, shard=self.micro_batch_index(self.batch_rank, micro))
        self.forwards += 1

    def _after_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        # After the last micro-batch of a step the balancing counts are complete: the bias moves
        # now, before the optimizer step (it only steers selection, so nothing reads it in between).
        if module.training and self.forwards % self.gradient_accumulation_steps == 0:
            for layer in self._layers:
                layer.update_expert_bias()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for model in [m for m, clock in _CLOCKS.items() if clock is self]:
            del _CLOCKS[model]


_CLOCKS: weakref.WeakKeyDictionary[torch.nn.Module, RoutingClock] = weakref.WeakKeyDictionary()


def restore_routing_clock(model: torch.nn.Module, micro_steps: int) -> None:
    """After a checkpoint load: the next forward is micro-step `micro_steps` of the run."""
    clock = _CLOCKS.get(model)
    if clock is not None:
        clock.forwards = micro_steps


def remove_routing_clock(model: torch.nn.Module) -> None:
    """Take the routing clock's hooks off `model` (the engine is destroyed); nothing if it has none."""
    clock = _CLOCKS.get(model)
    if clock is not None:
        clock.remove()


@dataclasses.dataclass(frozen=True)
class ExpertParallelState:
    """What expert parallelism did to one part: the part state surface of zerodist/comm/parts.py."""

    module: torch.nn.Module
    num_layers: int
    degree: int

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every layer's experts gathered from its expert group under global ids (collective)."""
        return gather_global_state_dict(self.module, state) if self.num_layers else state

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's experts of a global state dict, under local ids (no collective)."""
        return localize_state_dict(self.module, state) if self.num_layers else state

    def report(self) -> list[str]:
        return [f"expert parallel: {self.num_layers} MoE layer(s), degree {self.degree}"] if self.num_layers else []

    def remove_hooks(self) -> None:
        remove_routing_clock(self.module)
        mine = {id(m) for m in self.module.modules()}
        for container in expert_containers():
            if id(container) in mine:
                set_expert_order(container, None)


@dataclasses.dataclass(frozen=True)
class LayoutInvariantDealing:
    """The layout-invariant mode's order, from the engine: which micro-batch k a batch rank runs at
    a micro-step, whether they are dealt interleaved (ZeRO 2/3), and the canonical counter's sum."""

    micro_batch_index: Callable[[int, int], int]
    interleaved: bool
    tree_sum: Callable[[list[torch.Tensor]], torch.Tensor]


def apply_expert_parallel_part(model: torch.nn.Module, topology: comm.Topology, gradient_accumulation_steps: int,
                               dealing: LayoutInvariantDealing | None = None) -> ExpertParallelState:
    """The engine's step: `apply_expert_parallel`, and a `RoutingClock` when the part has MoE layers;
    in the layout-invariant mode (`dealing`), routing keyed by its micro-batch index and every expert
    container's per-source gradients summed in its order ([Note: experts in the mode] in ordered.py)."""
    num_layers = apply_expert_parallel(model, topology)
    if num_layers:
        RoutingClock(model, gradient_accumulation_steps, topology,
                     dealing.micro_batch_index if dealing is not None else None)
    degree = topology.size("expert")
    if dealing is not None and num_layers and degree > 1:
        first = topology.batch_rank - topology.axis_rank("expert")  # the expert group: consecutive batch ranks
        window = 1 if dealing.interleaved else gradient_accumulation_steps
        index = (lambda source, micro: dealing.micro_batch_index(first + source, micro))
        mine = {id(m) for m in model.modules()}
        for container in expert_containers():
            if id(container) in mine:
                set_expert_order(container, ExpertOrder(degree, window, index, dealing.tree_sum))
    return ExpertParallelState(model, num_layers, degree)
