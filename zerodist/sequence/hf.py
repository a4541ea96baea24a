"""Sequence-parallel attention for Hugging Face models, through transformers' attention-function
registry (`AttentionInterface`, `ALL_ATTENTION_FUNCTIONS`): a Llama-like model calls
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)` in every attention
layer, so registering one function and selecting it with the model's own
`set_attn_implementation` makes the model sequence-parallel without a change to its code.

The function receives this rank's slice of q, k, v ([batch, heads, seq/P, head_dim], rotary
embeddings already applied from the slice's position ids) and returns [batch, seq/P, heads,
head_dim], as the built-in functions do. The local attention is torch's
`scaled_dot_product_attention`, causal over the whole sequence (grouped k/v heads as they are);
the model's own causal mask is for the slice and is not used, so the mask function registered
under the same name builds none. transformers is imported only when a Hugging Face model is met.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.layer import engine_sequence, ulysses_attention
from zerodist.sequence.ring import ring_attention

ATTENTION_NAME = "zerodist_sequence_parallel"


def is_hf_model(model: torch.nn.Module) -> bool:
    """A transformers model whose attention goes through the registry."""
    config = getattr(model, "config", None)
    return hasattr(model, "set_attn_implementation") and hasattr(config, "_attn_implementation")


def hf_heads(model: torch.nn.Module) -> tuple[int, int] | None:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None)
    return heads, kv_heads if isinstance(kv_heads, int) else heads


def _local_causal(scale: float | None, causal: bool) -> Any:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return attend


def sequence_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; q, k, v are [batch, heads, seq/P, head_dim]."""
    settings = engine_sequence(module)
    if settings is None:
        raise SequenceParallelError(
            f"{type(module).__name__} runs the sequence-parallel attention function but no engine registered it; "
            "zerodist.initialize() with sequence_parallel_size > 1 sets it up (and engine.destroy() undoes it)")
    if dropout:
        raise SequenceParallelError(f"attention dropout {dropout} is not supported with sequence parallelism; "
                                    "set the model config's attention_dropout to 0")
    causal = bool(getattr(module, "is_causal", True))
    if settings.method == "ring":
        out = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), settings.group,
                             settings.layout, causal=causal, scale=scaling)
        return out, None
    out = ulysses_attention(query, key, value, settings.group, 1, 2, _local_causal(scaling, causal))
    return out.transpose(1, 2), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention is causal over the whole sequence by itself


# Engines whose model runs the registered function now: the registration is transformers' global
# state, so it lives exactly while one of them does (the last `unregister_attention()` removes it).
_registered_by = 0


def register_attention() -> None:
    """Register the function (and its mask function) under `ATTENTION_NAME` for one more engine;
    each call is paired with one `unregister_attention()`."""
    global _registered_by
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _no_mask)
    _registered_by += 1


def unregister_attention() -> None:
    """One engine is done with the function; the last one takes both registrations out again, so
    that nothing of zerodist stays in transformers' registries after destroy()."""
    global _registered_by
    _registered_by = max(0, _registered_by - 1)
    if _registered_by:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # transformers 5.x has `register` but no public way back: both registries are GeneralInterface
    # subclasses whose class-wide `_global_mapping` is what `register` writes.
    for registry in (AttentionInterface, type(ALL_MASK_ATTENTION_FUNCTIONS)):
        mapping = getattr(registry, "_global_mapping", None)
        if isinstance(mapping, dict) and mapping.get(ATTENTION_NAME) in (sequence_parallel_attention, _no_mask):
            del mapping[ATTENTION_NAME]


def is_registered() -> bool:
    """Whether transformers' attention registry holds the function now."""
    from transformers import AttentionInterface

    return ATTENTION_NAME in getattr(AttentionInterface, "_global_mapping", {})
