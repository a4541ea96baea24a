"""`zerodist train --moe N`: the MoE demo model, its load-balance summary and the expert-load plot.

    tracker = LoadTracker(model)           # forward hooks on the model's MoE layers
    ... train ...
    load = tracker.gather()                # collective: routes per expert summed over the ranks
    lines = load_lines(load, ...)          # rank 0: the summary's "expert load" section
    plot_expert_load(load, path, title)    # rank 0: expert_load.png
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import torch

import zerodist.comm as comm
from zerodist.models.gpt import gpt_config
from zerodist.models.moe_gpt import MoEConfig, MoEGPT
from zerodist.moe.gating import capacity
from zerodist.moe.layer import MoE
from zerodist.utils import format_bytes

# The demo's routing: top-1 with 25% spare capacity (Switch's usual training setting).
DEMO_K, DEMO_CAPACITY_FACTOR = 1, 1.25


def build_moe_model(preset: str, num_experts: int, world_size: int, seq_len: int | None = None) -> MoEGPT:
    """The demo GPT with an MoE layer of `num_experts` experts in every block, expert parallel
    over `world_size` ranks (each holds `num_experts / world_size`)."""
    if num_experts < 1 or num_experts % world_size:
        raise ValueError(f"--moe {num_experts}: the experts are spread over the {world_size} rank(s), so their "
                         f"number must be a positive multiple of {world_size}")
    moe = MoEConfig(num_experts=num_experts, ep_size=world_size, k=DEMO_K, capacity_factor=DEMO_CAPACITY_FACTOR)
    return MoEGPT(gpt_config(preset, **({"seq_len": seq_len} if seq_len else {})), moe)


@dataclasses.dataclass
class ExpertLoad:
    """Per MoE layer: routes per expert (before drops) and routes dropped, summed over ranks and steps."""

    routes: list[list[int]]
    dropped: list[int]

    def fractions(self, layer: int) -> list[float]:
        total = sum(self.routes[layer])
        return [count / total if total else 0.0 for count in self.routes[layer]]


class LoadTracker:
    """Adds up each MoE layer's `last_stats` after every training forward (a forward hook on
    zerodist's own MoE modules)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.routes = [[0] * layer.num_experts for layer in self.layers]
        self.dropped = [0] * len(self.layers)
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def _hook(self, index: int):
        def record(module: torch.nn.Module, args: object, output: object) -> None:
            stats = cast(MoE, module).last_stats  # the hook is on MoE layers only
            if module.training and stats is not None:
                self.routes[index] = [a + b for a, b in zip(self.routes[index], stats.exp_counts)]
                self.dropped[index] += stats.num_dropped
        return record

    def gather(self) -> ExpertLoad:
        """Every rank's counts summed (collective)."""
        for handle in self.handles:
            handle.remove()
        if not self.layers:
            return ExpertLoad([], [])
        counts = torch.tensor([row + [dropped] for row, dropped in zip(self.routes, self.dropped)], dtype=torch.float64)
        comm.all_reduce(counts)
        rows = counts.long().tolist()
        return ExpertLoad([row[:-1] for row in rows], [row[-1] for row in rows])


def all_to_all_formula_bytes(model: MoEGPT, tokens_per_micro_batch: int, accumulation_steps: int,
                             element_bytes: int, layers: int | None = None) -> int:
    """Capacity mode: 4 all-to-alls of E * C * M elements per MoE layer and micro-step; `layers`: the
    MoE layers this rank runs (a pipeline stage's), by default all of the model's."""
    config = model.moe_config
    slots = capacity(tokens_per_micro_batch, config.num_experts, config.k, config.capacity_factor, config.min_capacity)
    per_layer = 4 * config.num_experts * slots * model.config.d_model * element_bytes
    return per_layer * (len(model.moe_layers()) if layers is None else layers) * accumulation_steps


def load_lines(load: ExpertLoad, *, measured_bytes_per_step: float, formula_bytes_per_step: int) -> list[str]:
    """The summary's section: each layer's share per expert, imbalance (max / mean) and drops."""
    lines = [f"expert load (share of routes per expert over the run, all ranks; top-{DEMO_K}, "
             f"capacity factor {DEMO_CAPACITY_FACTOR}):"]
    for layer, routes in enumerate(load.routes):
        shares = load.fractions(layer)
        mean = sum(routes) / len(routes) if routes else 0
        imbalance = max(routes) / mean if mean else 0.0
        dropped = load.dropped[layer] / sum(routes) if sum(routes) else 0.0
        lines.append(f"  MoE layer {layer}: " + " ".join(f"{s:6.1%}" for s in shares) +
                     f"   imbalance {imbalance:.2f}, dropped {dropped:.1%}")
    lines.append(f"all-to-all per step on this rank: {format_bytes(int(measured_bytes_per_step))} measured, "
                 f"{format_bytes(formula_bytes_per_step)} by 4 x E x C x M x bytes per MoE layer and micro-step")
    return lines


def plot_expert_load(load: ExpertLoad, path: Path, title: str) -> str | None:
    """expert_load.png: one bar group per MoE layer; returns why it was skipped, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install 'zerodist[plot]'); no expert-load plot written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    num_layers = len(load.routes)
    num_experts = len(load.routes[0]) if load.routes else 0
    width = 0.8 / max(1, num_experts)
    for expert in range(num_experts):
        shares = [load.fractions(layer)[expert] for layer in range(num_layers)]
        axes.bar([layer + expert * width for layer in range(num_layers)], shares, width, label=f"expert {expert}")
    if num_experts:
        axes.axhline(1 / num_experts, color="black", linewidth=0.8, linestyle="--", label="balanced")
    axes.set_xticks([layer + 0.4 - width / 2 for layer in range(num_layers)], [f"layer {i}" for i in range(num_layers)])
    axes.set_ylabel("share of routes")
    axes.set_title(title)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
