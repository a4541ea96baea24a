"""DeepSpeed's MoE helpers (`deepspeed.moe.utils`): which parameters are experts, and optimizer
parameter groups that keep experts apart.

Experts are recognised structurally: a parameter is an expert's when it belongs to an `Experts`
container that `MoE` built, never by the substring "expert" in its name (DeepSpeed's checkpoint
code does that, #7685) and never by a marker attribute on the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerodist.moe.experts import expert_containers

# DeepSpeed's default: no optimizer group of expert parameters above this many elements.
DEFAULT_MAX_GROUP_SIZE = 178956971


def _expert_group_names() -> dict[int, tuple[torch.Tensor, str]]:
    """id(param) -> (param, expert group name) for every parameter of every live expert container."""
    found: dict[int, tuple[torch.Tensor, str]] = {}
    for container in expert_containers():
        name = container.expert_group_name or "experts"
        for param in container.parameters():
            found[id(param)] = (param, name)
    return found


def _group_name_of(param: torch.Tensor, table: dict[int, tuple[torch.Tensor, str]]) -> str | None:
    entry = table.get(id(param))
    return entry[1] if entry is not None and entry[0] is param else None


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of a zerodist MoE layer's experts (DeepSpeed's `is_moe_param`)."""
    return _group_name_of(param, _expert_group_names()) is not None


def has_moe_layers(model: torch.nn.Module) -> tuple[bool, int]:
    """(whether `model` has MoE layers, how many): DeepSpeed's `has_moe_layers`."""
    from zerodist.moe.layer import MoE

    count = sum(1 for module in model.modules() if isinstance(module, MoE))
    return count > 0, count


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...],
        max_group_size: int | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """DeepSpeed's helper: move every expert parameter out of its group into a group of its own
    kind, `{**original, 'name': <expert group name>, 'moe': True}` (split so that no such group
    holds more than `max_group_size` elements), keeping the other options of the original
    group. Every group needs a `'name'`. The list is changed in place and returned."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise TypeError(f"param_groups must be a dict, list or tuple of dicts, got {type(param_groups).__name__}")
    for index, group in enumerate(param_groups):
        if "name" not in group:
            raise ValueError(f"parameter group {index} has no 'name'; DeepSpeed's MoE grouping needs one per group "
                             "(e.g. {'params': ..., 'name': 'dense'})")
    table = _expert_group_names()
    moved: list[dict[str, Any]] = []
    for group in param_groups:
        by_expert_group: dict[str, list[torch.Tensor]] = {}
        kept = []
        for param in group["params"]:
            name = _group_name_of(param, table)
            if name is None:
                kept.append(param)
            else:
                by_expert_group.setdefault(name, []).append(param)
        group["params"] = kept
        for name, params in by_expert_group.items():
            for chunk in _chunks(params, max_group_size):
                moved.append({**group, "name": name, "moe": True, "params": chunk})
    param_groups.extend(moved)
    return param_groups


def _chunks(params: list[torch.Tensor], max_size: int | None) -> Iterable[list[torch.Tensor]]:
    if max_size is None:
        yield params
        return
    current: list[torch.Tensor] = []
    size = 0
    for param in params:
        if current and size + param.numel() > max_size:
            yield current
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        yield current


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """DeepSpeed's helper: parameters (or parameter groups) in, MoE-split groups out. Bare
    parameters become one group named 'dense-params'; unnamed groups are named 'group-<index>'."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("model_parameters must be a non-empty list of parameters or of parameter-group dicts")
    if all(isinstance(p, torch.Tensor) for p in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer([{"params": model_parameters, "name": "dense-params"}])
    if all(isinstance(g, dict) for g in model_parameters):
        groups = [{**g, "name": g.get("name", f"group-{i}"), "params": list(g["params"])}
                  for i, g in enumerate(model_parameters)]
        return split_params_into_different_moe_groups_for_optimizer(groups)
    raise TypeError("model_parameters mixes tensors and parameter-group dicts; pass one kind")
