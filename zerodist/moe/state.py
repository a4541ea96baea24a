"""Expert state with global ids: the full model's state dict at any expert-parallel size.

A rank's `model.state_dict()` names its local experts `...deepspeed_experts.{local}.<rest>`.
`gather_global_state_dict` all-gathers them over each layer's expert group and names them by
global id (`expert_rank * E_local + local`), so the result is the state dict of the same model
built with `ep_size=1`: it loads there with `strict=True`. `localize_state_dict` goes back: it
picks this rank's experts out of a global state dict and renames them to local ids, so a model
saved at one expert-parallel size loads at any other.

Experts are found structurally (the `Experts` container of each `MoE` layer), never by the
substring "expert" in a key: a dense `expert_bias` or a buffer `experts_mask` is left alone.
"""

from __future__ import annotations

import re

import torch

from zerodist import comm
from zerodist.moe.layer import _CONTEXTS, MoE


def moe_layers(model: torch.nn.Module) -> list[tuple[str, MoE]]:
    """(qualified name, layer) of every MoE layer of `model`, in `named_modules()` order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def experts_prefix(layer_name: str) -> str:
    """The state-dict key prefix of a layer's experts, up to and including the dot before the id."""
    return (f"{layer_name}." if layer_name else "") + "deepspeed_moe.experts.deepspeed_experts."


def _split_key(key: str, prefix: str) -> tuple[int, str] | None:
    if not key.startswith(prefix):
        return None
    match = re.match(r"(\d+)\.(.+)", key[len(prefix):])
    return (int(match.group(1)), match.group(2)) if match else None


def gather_global_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (this rank's `model.state_dict()`, local expert ids) with every layer's experts
    gathered from its expert group and keyed by global id. All ranks must call it together."""
    result = dict(state)
    for name, layer in moe_layers(model):
        prefix = experts_prefix(name)
        local_keys = sorted((k for k in state if _split_key(k, prefix)),
                            key=lambda k: _split_key(k, prefix) or (-1, ""))  # every key kept has one
        for key in local_keys:
            del result[key]
        context = _CONTEXTS.get(layer.deepspeed_moe)
        if layer.ep_size > 1 and context is None:
            raise RuntimeError(f"MoE layer '{name}' has ep_size={layer.ep_size} but no expert-parallel group; "
                               "call set_topology (or zerodist.initialize) first")
        for key in local_keys:
            local, rest = _split_key(key, prefix)  # type: ignore[misc]
            tensor = state[key].detach().contiguous()
            if layer.ep_size == 1:
                result[f"{prefix}{local}.{rest}"] = tensor
                continue
            gathered = tensor.new_empty(layer.ep_size * tensor.numel())  # flat: gloo wants matching dims
            comm.all_gather(gathered, tensor.reshape(-1), group=context.group)  # type: ignore[union-attr]
            gathered = gathered.view(layer.ep_size, *tensor.shape)
            for expert_rank in range(layer.ep_size):
                result[f"{prefix}{expert_rank * layer.num_local_experts + local}.{rest}"] = gathered[expert_rank].clone()
    return result


def localize_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A global state dict (experts keyed by global id) cut down to this rank's experts, keyed by
    local id: ready for `model.load_state_dict`. Raises when a layer's expert count differs."""
    result = dict(state)
    for name, layer in moe_layers(model):
        prefix = experts_prefix(name)
        by_global: dict[int, dict[str, torch.Tensor]] = {}
        for key in [k for k in state if _split_key(k, prefix)]:
            global_id, rest = _split_key(key, prefix)  # type: ignore[misc]
            by_global.setdefault(global_id, {})[rest] = result.pop(key)
        if by_global and sorted(by_global) != list(range(layer.num_experts)):
            raise ValueError(f"MoE layer '{name}': the state dict holds experts {sorted(by_global)} but the layer has "
                             f"num_experts={layer.num_experts} (global ids 0..{layer.num_experts - 1}); the expert "
                             "count must match (only the expert-parallel size may change)")
        for local, global_id in enumerate(layer.global_expert_ids()):
            for rest, tensor in by_global.get(global_id, {}).items():
                result[f"{prefix}{local}.{rest}"] = tensor
    return result
