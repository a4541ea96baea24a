"""``deepspeed.utils`` under ``import deepspeed`` served by zerodist: the names the Hugging Face stack
and DeepSpeed scripts import from it (``logger``, ``groups``, ``RepeatingLoader``,
``set_z3_leaf_modules``)."""

from __future__ import annotations

from typing import Any

import torch

from zerodist.runtime import groups
from zerodist.utils import RepeatingLoader, get_logger, log_rank0

__all__ = ["RepeatingLoader", "groups", "logger", "set_z3_leaf_modules", "z3_leaf_module"]
__path__: list[str] = []  # `deepspeed.utils.groups` is a submodule in DeepSpeed

# DeepSpeed's own logger: transformers sets its level from the Trainer's (deepspeed_init).
logger = get_logger("zerodist.deepspeed")

_LEAVES: dict[int, tuple[type, ...]] = {}


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[torch.nn.Module]:
    """DeepSpeed gathers a ZeRO-3 leaf module's parameters whole instead of hooking its submodules
    (MoE blocks whose experts run data-dependently). zerodist's stage 3 gathers each unit whole
    already, so this changes nothing here; it returns the modules it matched, as DeepSpeed does."""
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    matched = [m for m in model.modules() if isinstance(m, classes) or type(m).__name__ in names]
    if not matched:
        raise ValueError(f"set_z3_leaf_modules: no module of {leaf_module_classes!r} in the model")
    _LEAVES[id(model)] = classes
    log_rank0(logger, "set_z3_leaf_modules: %d module(s) marked; zerodist gathers each ZeRO-3 unit whole already, "
              "so this changes nothing", len(matched))
    return matched


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `set_z3_leaf_modules` was called on `model`."""
    return id(model) in _LEAVES
