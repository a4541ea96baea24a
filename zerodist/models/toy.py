"""A tiny deterministic MLP for engine tests, and a parameter counter."""

from __future__ import annotations

import torch
from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of elements over the model's distinct parameters (shared tensors count once)."""
    return sum(p.numel() for p in model.parameters())


def _width_coprime_to_6(at_least: int) -> int:
    """Smallest width >= ``at_least`` divisible by neither 2 nor 3 (hence not by 4 either)."""
    width = at_least
    while width % 2 == 0 or width % 3 == 0:
        width += 1
    return width


def make_mlp(in_dim: int = 16, hidden: int = 32, out_dim: int = 8, layers: int = 3, seed: int = 0) -> nn.Sequential:
    """``layers`` Linear layers with ReLU between them: in_dim -> hidden ... -> out_dim.

    The last hidden width is bumped to the next size divisible by neither 2 nor 3 (32 -> 35),
    so its bias has a numel that no world size of 2, 3 or 4 divides: sharding must pad.
    The defaults give 16 -> 32 -> 35 -> 8 (1,987 parameters).

    Weights depend only on ``seed``; torch's global RNG is left as it was.
    """
    if layers < 1:
        raise ValueError(f"make_mlp needs layers >= 1, got {layers}")
    widths = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    if layers >= 2:
        widths[-2] = _width_coprime_to_6(hidden)
    modules: list[nn.Module] = []
    # fork_rng restores the global RNG on exit, so building a toy model does not shift the
    # random stream a test draws its data from afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            if i:
                modules.append(nn.ReLU())
            modules.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*modules)
