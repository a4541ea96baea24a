"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (accelerate's ``get_state_dict`` calls it)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Every tensor in `item` (nested lists, tuples, dicts) copied to `device`, so a saved view does
    not drag its whole storage into the file (DeepSpeed's function)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
