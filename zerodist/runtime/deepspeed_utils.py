"""``deepspeed.utils`` under ``import deepspeed`` served by zerodist: the names the Hugging Face stack
and DeepSpeed scripts import from it (``logger``, ``groups``, ``RepeatingLoader``, the ZeRO-3 leaf-module
marks, ``set_log_level_from_string``, and the per-parameter accessors ``safe_get_full_fp32_param`` and
kin, zerodist/engine/deepspeed_tensors.py)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from zerodist.engine.deepspeed_tensors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zerodist.runtime import groups
from zerodist.utils import RepeatingLoader, get_logger, log_rank0

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "groups", "logger", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_log_level_from_string",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module"]
__path__: list[str] = []  # `deepspeed.utils.groups` is a submodule in DeepSpeed

# DeepSpeed's own logger: transformers sets its level from the Trainer's (deepspeed_init).
logger = get_logger("zerodist.deepspeed")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """DeepSpeed's: set `custom_logger` (default: DeepSpeed's `logger`) and its handlers to the level named."""
    if log_level_str.lower() not in _LEVELS:
        raise ValueError(f"{log_level_str!r} is not one of the log levels {sorted(_LEVELS)}")
    target = logger if custom_logger is None else custom_logger
    target.setLevel(_LEVELS[log_level_str.lower()])
    for handler in target.handlers:
        handler.setLevel(_LEVELS[log_level_str.lower()])


# [Note: leaf marks] DeepSpeed marks a ZeRO-3 leaf module with an attribute on it (`_z3_leaf`); zerodist
# sets no attribute on user modules, so the marks live here, weakly, by module. The engine does not read
# them: stage 3's gather units are chosen by `zerodist.stage3_unit_classes` (each unit gathered whole), so
# a leaf module whose children run by data- or rank-dependent control flow needs its class named there
# (DeepSpeed's leaf makes it one gather); the functions answer as DeepSpeed's.
_LEAF: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` itself is marked a ZeRO-3 leaf module."""
    return _LEAF.get(model, False)


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    _LEAF[model] = flag


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` (itself included) marked as leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def _class_matches(module: torch.nn.Module, wanted: Any) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(model: torch.nn.Module, leaf_module_classes: list[Any], flag: bool, raise_if_not_found: bool
          ) -> list[torch.nn.Module]:
    if not all(isinstance(c, (type, str)) for c in leaf_module_classes):
        raise TypeError(f"leaf_module_classes must be a list of types or class names, got {leaf_module_classes!r}")
    matched = [m for m in model.modules() if any(_class_matches(m, c) for c in leaf_module_classes)]
    if not matched and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {type(model).__name__}")
    for module in matched:
        _LEAF[module] = flag
    return matched


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any], raise_if_not_found: bool = True
                        ) -> list[torch.nn.Module]:
    """DeepSpeed gathers a ZeRO-3 leaf module's parameters whole instead of hooking its submodules
    (MoE blocks whose experts run data-dependently). This marks and returns the modules of those
    classes (or class names, plain or fully qualified), as DeepSpeed does; zerodist's engine does not
    read the marks: name the class in `zerodist.stage3_unit_classes` to gather it as one unit."""
    matched = _mark(model, leaf_module_classes, True, raise_if_not_found)
    if matched:
        log_rank0(logger, "set_z3_leaf_modules: %d module(s) marked; zerodist's stage 3 gathers by its units: "
                  "name %s in the config's zerodist.stage3_unit_classes to gather each as one unit", len(matched),
                  sorted({type(m).__name__ for m in matched}))
    return matched


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any], raise_if_not_found: bool = True
                          ) -> list[torch.nn.Module]:
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules named (as in `named_modules()`); returns (matched, missing names)."""
    by_name = dict(model.named_modules())
    missing = [name for name in module_names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    matched = [by_name[name] for name in module_names if name in by_name]
    for module in matched:
        _LEAF[module] = flag
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules whose `named_modules()` name ends with a suffix; returns (matched, missing suffixes)."""
    matched: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        found = [m for name, m in model.named_modules() if name.endswith(suffix)]
        if not found:
            missing.append(suffix)
        for module in found:
            _LEAF[module] = flag
            matched.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    return list(matched.values()), missing
