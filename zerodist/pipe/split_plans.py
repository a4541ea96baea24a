"""Split plans: what `split_model` needs to know about a model family to cut it into pipeline stages.

A plan names, by the model's own dotted module names, the parts of a forward that is
embed -> blocks -> final norm -> head, and holds the glue between them:

    SplitPlan(embed=("tok_emb", "pos_emb", "emb_dropout"), blocks="blocks", norm="ln_f", head="lm_head",
              embed_fn=lambda model, ids: ..., block_fn=lambda model, block, hidden: block(hidden))

Only hidden states travel between stages; whatever a block needs besides them (rotary embeddings,
a causal mask, position ids) its `block_fn` recomputes from the hidden states' shape on the stage
that runs it. `shared` names parameterless modules every stage holds for that (Llama's
`model.rotary_emb`). The built-in plans (the demo GPT, Hugging Face Llama and GPT-2) are entries of
`BUILTIN_PLANS`, found by `find_split_plan`; any other model of that shape takes a plan written
the same way (`split_model(model, plan=SplitPlan(...))`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BUILTIN_PLANS", "SplitPlan", "UnknownModelError", "find_split_plan", "token_cross_entropy",
           "token_positions"]


class UnknownModelError(ValueError):
    """No built-in split plan knows this model: give one (`split_model(model, plan=SplitPlan(...))`)."""


EmbedFn = Callable[[nn.Module, Any], torch.Tensor]
BlockFn = Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]
LayerFn = Callable[[nn.Module, Any], Any]  # (the norm or head module, what the previous layer returned)
LossFor = Callable[[nn.Module], Callable[..., torch.Tensor]]  # the user's model -> loss_fn(output, labels)


def _first_embedding(model: nn.Module, plan: SplitPlan, inputs: Any) -> torch.Tensor:
    return model.get_submodule(plan.embed[0])(inputs)


def _plain_block(model: nn.Module, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return block(hidden)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """The parts of a model whose forward is embed -> blocks -> norm -> head, by its own names.

    - `embed`: the modules the first layer runs (their state goes to the first stage);
      `embed_fn(model, inputs)` -> hidden states (default: the first of them applied to the inputs).
    - `blocks`: the `nn.ModuleList` (or `nn.Sequential`) of blocks; `block_fn(model, block, hidden)`
      -> hidden states (default: `block(hidden)`).
    - `norm`: the final norm applied to the last block's output (None if the model has none).
    - `head`: the output layer, applied to the norm's output: its result goes to `loss_fn`.
    - `shared`: parameterless modules the glue uses on every stage (rotary embeddings).
    - `layer_fn(module, value)`: how the norm and the head apply to what the previous layer
      returned (default `module(value)`); `loss_for(model)`: the loss `split_model` uses by default
      (default next-token cross-entropy). A model that carries more than the hidden states between
      its blocks (an MoE model's summed balance loss) passes a tuple and sets both.
    `model` is the user's whole model, for reading its config and modules (never written)."""

    embed: tuple[str, ...]
    blocks: str
    norm: str | None
    head: str
    shared: tuple[str, ...] = ()
    embed_fn: EmbedFn | None = None
    block_fn: BlockFn | None = None
    name: str = "a user's plan"
    layer_fn: LayerFn | None = None
    loss_for: LossFor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.embed, str):
            object.__setattr__(self, "embed", (self.embed,))
        if isinstance(self.shared, str):
            object.__setattr__(self, "shared", (self.shared,))
        if not self.embed:
            raise ValueError("SplitPlan(embed=...) names at least one module (the token embedding)")

    def run_embed(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        if self.embed_fn is None:
            return _first_embedding(model, self, inputs)
        return self.embed_fn(model, inputs)

    def run_block(self, model: nn.Module, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return (self.block_fn or _plain_block)(model, block, hidden)

    def run_layer(self, module: nn.Module, value: Any) -> Any:
        return module(value) if self.layer_fn is None else self.layer_fn(module, value)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of (batch, seq, vocab) logits against (batch, seq) labels that are
    already the next tokens (label -100 ignored): the demo GPT's `forward(idx, targets)` loss."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)), labels.reshape(-1).long(), ignore_index=-100)


def token_positions(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The places in the whole sequence of the tokens `hidden` (batch, seq, ...) holds: 0..seq-1, or
    under sequence parallelism those of this rank's slice, which the stage view `model` numbers
    ([Note: sequence x pipe] in zerodist/pipe/split.py). A plan's glue numbers tokens with it."""
    if getattr(type(model), "token_positions", None) is not None:
        return model.token_positions(hidden.shape[1], hidden.device)  # type: ignore[no-any-return]
    return torch.arange(hidden.shape[1], device=hidden.device)


# ---------------------------------------------------------------------------------------- the demo GPT
def _gpt_embed(model: Any, idx: torch.Tensor) -> torch.Tensor:  # zerodist.models.gpt.GPT.forward's first line
    return model.emb_dropout(model.tok_emb(idx.long()) + model.pos_emb(token_positions(model, idx)))


GPT_SPLIT_PLAN = SplitPlan(embed=("tok_emb", "pos_emb", "emb_dropout"), blocks="blocks", norm="ln_f",
                           head="lm_head", embed_fn=_gpt_embed, name="the built-in demo GPT plan")


# ---------------------------------------------------------------------------------------- the demo MoE GPT
# [Note: MoE balance loss across stages] MoEGPT's blocks return (hidden, l_aux) and its loss adds
# aux_loss_coef times their sum: the stages pass (hidden, summed l_aux so far), and the last one's
# loss is the model's own.
def _moe_gpt_embed(model: Any, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.tok_emb(idx.long()) + model.pos_emb(token_positions(model, idx))
    return hidden, hidden.new_zeros((), dtype=torch.float32)


def _moe_gpt_block(model: Any, block: nn.Module, carried: Any) -> Any:
    hidden, aux = carried
    hidden, l_aux = block(hidden)
    return hidden, aux + l_aux


def _moe_gpt_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    coefficient = model.moe_config.aux_loss_coef  # type: ignore[union-attr]

    def loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        return token_cross_entropy(logits, labels) + coefficient * aux
    return loss


MOE_GPT_SPLIT_PLAN = SplitPlan(embed=("tok_emb", "pos_emb"), blocks="blocks", norm="ln_f", head="lm_head",
                               embed_fn=_moe_gpt_embed, block_fn=_moe_gpt_block,  # type: ignore[arg-type]
                               layer_fn=lambda module, carried: (module(carried[0]), carried[1]),
                               loss_for=_moe_gpt_loss, name="the built-in demo MoE GPT plan")


# ---------------------------------------------------------------------------------------- Hugging Face
def _causal_mask(model: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The mask the model's own forward builds for a full causal sequence (None under SDPA, which
    then runs causally; a 4-d mask under eager attention)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                              position_ids=position_ids)


def _llama_block(model: Any, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    position_ids = token_positions(model, hidden).unsqueeze(0)
    rotary = model.model.rotary_emb(hidden, position_ids=position_ids)
    return block(hidden, attention_mask=_causal_mask(model, hidden, position_ids), position_ids=position_ids,
                 position_embeddings=rotary, use_cache=False)


HF_LLAMA_SPLIT_PLAN = SplitPlan(embed=("model.embed_tokens",), blocks="model.layers", norm="model.norm",
                                head="lm_head", shared=("model.rotary_emb",), block_fn=_llama_block,
                                name="the built-in Hugging Face Llama plan")


def _gpt2_embed(model: Any, input_ids: torch.Tensor) -> torch.Tensor:  # GPT2Model.forward, without a cache
    transformer = model.transformer
    position_ids = token_positions(model, input_ids).unsqueeze(0)
    return transformer.drop(transformer.wte(input_ids.long()) + transformer.wpe(position_ids))


def _gpt2_block(model: Any, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    position_ids = token_positions(model, hidden).unsqueeze(0)
    return block(hidden, None, _causal_mask(model, hidden, position_ids), None, use_cache=False,
                 position_ids=position_ids)


HF_GPT2_SPLIT_PLAN = SplitPlan(embed=("transformer.wte", "transformer.wpe", "transformer.drop"), blocks="transformer.h",
                               norm="transformer.ln_f", head="lm_head", embed_fn=_gpt2_embed, block_fn=_gpt2_block,
                               name="the built-in Hugging Face GPT-2 plan")


def _class_path(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _model_type(model: nn.Module) -> Any:
    return getattr(getattr(model, "config", None), "model_type", None)


# (what the entry is for, does it match the model, its plan). A Hugging Face entry matches the
# causal-LM class (the one with the head), by its config's model_type.
BUILTIN_PLANS: list[tuple[str, Callable[[nn.Module], bool], SplitPlan]] = [
    ("zerodist.models.gpt.GPT", lambda m: _class_path(m) == "zerodist.models.gpt.GPT", GPT_SPLIT_PLAN),
    ("zerodist.models.moe_gpt.MoEGPT", lambda m: _class_path(m) == "zerodist.models.moe_gpt.MoEGPT",
     MOE_GPT_SPLIT_PLAN),
    ("Hugging Face Llama (LlamaForCausalLM)", lambda m: _model_type(m) == "llama" and hasattr(m, "lm_head"),
     HF_LLAMA_SPLIT_PLAN),
    ("Hugging Face GPT-2 (GPT2LMHeadModel)", lambda m: _model_type(m) == "gpt2" and hasattr(m, "lm_head"),
     HF_GPT2_SPLIT_PLAN),
]


def find_split_plan(model: nn.Module) -> SplitPlan:
    """The built-in plan of `model`'s family, or `UnknownModelError` saying how to write one."""
    for _, matches, plan in BUILTIN_PLANS:
        if matches(model):
            return plan
    known = ", ".join(name for name, _, _ in BUILTIN_PLANS)
    raise UnknownModelError(
        f"split_model has no plan for {type(model).__name__} (built-in plans: {known}). For a model whose forward "
        "is embed -> blocks -> final norm -> head, give one by the model's own module names: "
        "split_model(model, plan=zerodist.pipe.SplitPlan(embed=('embed',), blocks='layers', norm='norm', "
        "head='head', embed_fn=..., block_fn=...)); embed_fn(model, inputs) and block_fn(model, block, hidden) "
        "are the glue between them (defaults: the first embed module applied to the inputs, block(hidden))")
