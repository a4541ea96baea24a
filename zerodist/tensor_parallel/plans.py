"""Built-in plans: the demo GPT (`zerodist.models.gpt`), Hugging Face Llama-style models and GPT-2.

The demo GPT's attention reshapes its fused QKV output with the *global* head count
(`view(batch, seq, 3, self.n_heads, d_model // self.n_heads)`), which a column-parallel QKV
cannot satisfy, so its plan replaces each attention module with `HeadParallelAttention`: the same
submodule names (`qkv`, `proj`, `resid_dropout`, so the same `state_dict()` keys), this rank's
heads only. Everything else in the GPT stays as written.

A Hugging Face Llama computes its head count from the projection's output
(`view(*input_shape, -1, self.head_dim)`), so the column/row swaps alone parallelize it: its own
`config.base_model_tp_plan` is used, plus the vocab-parallel embedding and a gathered LM head.

Hugging Face GPT-2 needs three things more (see `hf_gpt2_plan`): its `Conv1D` layers store the
weight transposed (`conv1d.py`); its attention splits the fused `c_attn` output by the *global*
`split_size`, so each attention module is replaced by an instance of a subclass of its own class
that holds this rank's heads (GPT-2's forward, names and math unchanged); and its LM head is tied
to `wte`, which `TiedHead` keeps tied over the vocab-parallel slice.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.comm.topology import Topology
from zerodist.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerodist.tensor_parallel.domino import DominoConfig, ResidualBranch, apply_domino
from zerodist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from zerodist.tensor_parallel.operators import TensorRegion, check_divisible
from zerodist.tensor_parallel.plan import (
    Colwise,
    PlanEntry,
    PlanError,
    PrepareInput,
    Replace,
    ScatterInput,
    Sequence,
    TiedHead,
    Vocab,
    shared_inputs,
)
from zerodist.tensor_parallel.random import RNGTracker


class HeadParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads: QKV column-parallel (fused, each of q, k, v
    split by heads), the output projection row-parallel. Built from a demo-GPT attention."""

    def __init__(self, attention: Any, region: TensorRegion, sequence_parallel: bool,  # models.gpt.CausalSelfAttention
                 rng: RNGTracker | None = None):
        super().__init__()
        d_model = attention.qkv.in_features
        self.num_local_heads = check_divisible(attention.n_heads, region.size, "the number of attention heads")
        self.dropout = attention.dropout
        self.rng = rng
        self.qkv = ColumnParallelLinear.from_linear(attention.qkv, region, sequence_parallel=sequence_parallel,
                                                    fused=(d_model,) * 3)
        self.proj = RowParallelLinear.from_linear(attention.proj, region, sequence_parallel=sequence_parallel)
        self.resid_dropout = attention.resid_dropout
        # The model's `DistributedAttention` (no parameters): plain attention over this rank's heads,
        # or, with a sequence axis, Ulysses / the ring over them ([Note: sequence x tensor] in
        # zerodist/sequence/apply.py). Kept by reference, so the engine's sequence step finds it.
        self.core = getattr(attention, "core", None)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention output, (batch, seq, d_model / t), before the projection."""
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.view(batch, seq, 3, self.num_local_heads, -1).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p and self.rng is not None:
            with self.rng.fork("sharded"):  # different heads: different masks on each rank
                y = self._attention(q, k, v, dropout_p)
        else:
            y = self._attention(q, k, v, dropout_p)
        return y.transpose(1, 2).reshape(batch, seq, -1)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if self.core is not None:  # (batch, heads, seq, head_dim), as the demo GPT's own attention calls it
            return cast(torch.Tensor, self.core(q, k, v, dropout_p=dropout_p))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.proj(self.attend(x)))


def gpt_plan(*, sequence_parallel: bool = False, rng: RNGTracker | None = None) -> dict[str, str | PlanEntry]:
    """The plan for `zerodist.models.gpt.GPT` (untied embeddings). Pass the same
    `sequence_parallel` to `parallelize`."""
    build = functools.partial(_build_attention, rng=rng)
    plan: dict[str, str | PlanEntry] = {
        "tok_emb": "vocab",
        "blocks.*.attn": Replace(build),
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": "rowwise",
        "lm_head": "colwise_rep",
    }
    if sequence_parallel:
        plan.update({"pos_emb": "sequence_scatter", "blocks.*.ln_1": "sequence", "blocks.*.ln_2": "sequence",
                     "ln_f": "sequence"})
    return plan


def moe_gpt_plan(model: nn.Module, *, sequence_parallel: bool = False, rng: RNGTracker | None = None
                 ) -> dict[str, str | PlanEntry]:
    """The plan for the demo MoE GPT (`zerodist.models.moe_gpt.MoEGPT`, the same attention and MLP
    classes as the demo GPT): `gpt_plan`'s entries for the modules it has, the dense blocks' MLPs
    named one by one, so that the MoE blocks' experts stay whole, replicated over the tensor axis
    (each tensor rank routes the same tokens; Megatron's experts without expert-tensor parallelism)."""
    if sequence_parallel:
        raise PlanError("Megatron-style sequence parallelism on the demo MoE GPT: its MoE layers route whole "
                        "tokens of the replicated stream; leave zerodist.tensor_parallel.sequence_parallel off")
    plan = gpt_plan(rng=rng)
    del plan["blocks.*.mlp.fc_in"], plan["blocks.*.mlp.fc_out"]
    for index, block in enumerate(cast(nn.ModuleList, model.blocks)):
        if isinstance(getattr(block, "mlp", None), nn.Module):
            plan[f"blocks.{index}.mlp.fc_in"], plan[f"blocks.{index}.mlp.fc_out"] = "colwise", "rowwise"
    return plan


def _build_attention(module: nn.Module, region: TensorRegion, sequence_parallel: bool,
                     rng: RNGTracker | None) -> HeadParallelAttention:
    return HeadParallelAttention(module, region, sequence_parallel, rng)


def gpt_block_branches(block: nn.Module) -> list[ResidualBranch]:
    """The demo GPT block's two residual branches, after `gpt_plan` (head-parallel attention; MLP
    with column `fc_in` and row `fc_out`), for the Domino schedule."""
    # After gpt_plan: attention head-parallel, the MLP's fc_in column- and fc_out row-parallel.
    attn, mlp = cast(HeadParallelAttention, block.attn), cast(nn.Module, block.mlp)
    fc_out = cast(RowParallelLinear, mlp.fc_out)
    # [Note: Domino at ZeRO-3] The MLP's finish runs in the next block under inter-layer overlap,
    # after ZeRO-3 freed this block's parameters: it adds a copy of the bias taken now, while the
    # block is gathered (the same values; its gradient reaches the bias through the copy).
    last_bias = None if fc_out.bias is None else fc_out.bias * 1
    return [
        ResidualBranch(lambda x: attn.proj.partial(attn.attend(block.ln_1(x))),  # type: ignore[operator]
                       lambda y: attn.resid_dropout(attn.proj.add_bias(y))),
        ResidualBranch(lambda x: fc_out.partial(mlp.act(mlp.fc_in(block.ln_2(x)))),  # type: ignore[operator]
                       lambda y: mlp.dropout(y if last_bias is None else y + last_bias)),  # type: ignore[operator]
    ]


def gpt_domino(model: nn.Module, topology: Topology, config: DominoConfig) -> nn.Module:
    """Run a `gpt_plan`-parallelized demo GPT's blocks with the Domino schedule (in place)."""
    apply_domino(cast(nn.ModuleList, model.blocks), gpt_block_branches, TensorRegion.of(topology), config)
    return model


def hf_llama_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, str | PlanEntry]:
    """The plan for a Hugging Face `LlamaForCausalLM`-like model: its config's
    `base_model_tp_plan` under `model.`, the embedding vocab-parallel, the LM head gathered (and
    kept tied to the embedding when `tie_word_embeddings`); the attention and the MLP prepare their
    input once (`PrepareInput`), so q, k and v (gate and up) share one input-gradient all-reduce."""
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        raise ValueError(f"{type(model).__name__} has no config.base_model_tp_plan; write the plan by hand")
    prefix = getattr(model, "base_model_prefix", "model")
    plan: dict[str, str | PlanEntry] = {f"{prefix}.{pattern}": _hf_word(word) for pattern, word in base.items()}
    head, embedding = getattr(model, "lm_head", None), model.get_submodule(f"{prefix}.embed_tokens")
    tied = head is not None and head.weight is embedding.weight
    if type(embedding).forward is nn.Embedding.forward:
        plan[f"{prefix}.embed_tokens"] = "vocab"
        # tie_word_embeddings: the head keeps sharing the embedding's (vocab-parallel) weight
        plan["lm_head"] = TiedHead(f"{prefix}.embed_tokens") if tied else "colwise_rep"
    elif not tied:  # an embedding of its own forward (Gemma's scales its rows): kept whole, as the tied head
        plan["lm_head"] = "colwise_rep"
    if sequence_parallel:
        plan.update(_llama_sequence_parallel(model, prefix))
    # q/k/v and gate/up read one normalised input each: one copy to the region per module.
    return shared_inputs(model, plan)


def _llama_sequence_parallel(model: nn.Module, prefix: str) -> dict[str, str | PlanEntry]:
    """[Note: Megatron SP on Hugging Face models] Megatron's sequence parallelism splits the
    residual stream along the sequence between the tensor layers. A Hugging Face Llama builds its
    position ids, rotary embeddings and causal mask from the embedding's output length, and its
    attention takes its shapes from its input (`view(*input_shape, -1, head_dim)`), so the split
    cannot start at the embedding, nor the gather inside q_proj as in Megatron: the embedding's
    output stays whole (all-reduced: `Vocab(sequence_output=False)`), the first decoder layer's
    input is split (`ScatterInput`), each attention gathers its input as it is called
    (`PrepareInput(at_entry=True)`: q, k and v share that gather and its one reduce-scatter), the
    MLPs gather in their first column layer, every row layer reduce-scatters, the norms run on
    the slices (`sequence`: their gradients summed over tensor too), and the head gathers the
    final norm's slices. Forward per block: 2 all-gathers and 2 reduce-scatters of T x hidden
    instead of 2 all-reduces (the same bytes), plus one all-reduce at the embedding."""
    layers = getattr(model.get_submodule(prefix), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise PlanError(f"{type(model).__name__} has no {prefix}.layers: the Llama plan's sequence parallelism "
                        "needs its decoder layers")
    norms = {name.rpartition(".")[2] for name, module in layers[0].named_children()
             if "norm" in name and not list(module.children())}
    if not norms or not hasattr(model.get_submodule(prefix), "norm"):
        raise PlanError(f"{type(model).__name__}'s decoder layers hold no norms by name ({list(dict(layers[0].named_children()))}); "
                        "write the sequence-parallel plan by hand")
    plan: dict[str, str | PlanEntry] = {
        f"{prefix}.embed_tokens": Vocab(sequence_output=False),
        f"{prefix}.layers.0": ScatterInput(),
        f"{prefix}.layers.*.self_attn": PrepareInput(at_entry=True),
        f"{prefix}.layers.*.mlp": PrepareInput(),
        f"{prefix}.norm": "sequence",
    }
    plan.update({f"{prefix}.layers.*.{norm}": "sequence" for norm in sorted(norms)})
    return plan


def _hf_word(word: str) -> str:
    # Hugging Face's plan words that mean ours; anything else is refused by parallelize.
    return {"colwise_rep": "colwise_rep", "local_colwise": "colwise", "local_rowwise": "rowwise"}.get(word, word)


# ---------------------------------------------------------------------------- Hugging Face GPT-2
def hf_gpt2_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, str | PlanEntry]:
    """The plan for Hugging Face's `GPT2LMHeadModel` (and `GPT2Model`, or any model built from
    `GPT2Block`s under `transformer.h` / `h`): `wte` vocab-parallel, each attention head-parallel
    (`c_attn` column-parallel with q, k and v split by heads, `c_proj` row-parallel), the MLP's
    `c_fc` column- and `c_proj` row-parallel, the tied `lm_head` over `wte`'s slice with gathered
    logits (so `model(input_ids, labels=...)`'s loss is Hugging Face's own). `wpe` and the
    LayerNorms stay replicated. With `sequence_parallel`, as for Llama ([Note: Megatron SP on
    Hugging Face models]): `wte`'s output stays whole (GPT-2 builds positions and its causal mask
    from it), the first block's input is split, the LayerNorms run on the slices; GPT-2's attention
    takes its shapes from `c_attn`'s output, so `c_attn` gathers its input itself."""
    config = getattr(model, "config", None)
    if getattr(config, "add_cross_attention", False):
        raise PlanError("the GPT-2 plan does not split cross-attention (config.add_cross_attention); write the plan "
                        "by hand")
    prefix = "transformer." if isinstance(getattr(model, "transformer", None), nn.Module) else ""
    plan: dict[str, str | PlanEntry] = {
        f"{prefix}wte": "vocab",
        f"{prefix}h.*.attn": Replace(_gpt2_attention),
        f"{prefix}h.*.mlp.c_fc": Replace(lambda conv, region, sp: ColumnParallelConv1D(conv, region,
                                                                                       sequence_parallel=sp)),
        f"{prefix}h.*.mlp.c_proj": Replace(lambda conv, region, sp: RowParallelConv1D(conv, region,
                                                                                      sequence_parallel=sp)),
    }
    if sequence_parallel:
        plan.update({f"{prefix}wte": Vocab(sequence_output=False), f"{prefix}h.0": ScatterInput(),
                     f"{prefix}h.*.ln_1": "sequence", f"{prefix}h.*.ln_2": "sequence",
                     # GPT2Model views ln_f's output by the input's (batch, seq): gathered there, so the
                     # head reads a whole sequence
                     f"{prefix}ln_f": Sequence(gather_output=True)})
    head = getattr(model, "lm_head", None)
    if head is not None:
        wte = model.get_submodule(f"{prefix}wte")
        plan["lm_head"] = TiedHead(f"{prefix}wte", sequence_input=False) if head.weight is wte.weight \
            else Colwise(gather_output=True, sequence_input=False)
    return plan


@functools.lru_cache(maxsize=None)
def _head_parallel_class(base: type) -> type:
    """A subclass of the model's own attention class: its forward, unchanged, runs on our instance
    (which holds this rank's heads), and `isinstance` checks (Hugging Face's output recorders) hold."""
    return type(f"HeadParallel{base.__name__}", (base,), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} over this rank's heads (built by zerodist.tensor_parallel.hf_gpt2_plan).",
    })


def _gpt2_attention(attention: Any, region: TensorRegion, sequence_parallel: bool) -> nn.Module:
    """A new attention module (never the user's, which is left untouched) of a subclass of
    `type(attention)`, with its plain attributes, `c_attn` column-parallel with q, k and v each split
    by heads, `c_proj` row-parallel, the dropouts shared, and `split_size` / `num_heads` local.
    GPT-2's forward splits `c_attn`'s output by `split_size` and infers the head count from it.
    `attention` is Hugging Face's GPT2Attention, read by attribute: transformers is not imported here."""
    embed_dim = attention.embed_dim
    if attention.split_size != embed_dim or attention.c_attn.weight.shape != (embed_dim, 3 * embed_dim):
        raise PlanError(f"{type(attention).__name__} is not GPT-2's self-attention as the plan knows it "
                        f"(split_size {attention.split_size}, c_attn {tuple(attention.c_attn.weight.shape)})")
    if list(attention.buffers(recurse=False)):
        raise PlanError(f"{type(attention).__name__} holds buffers this plan does not know how to carry over")
    num_local_heads = check_divisible(attention.num_heads, region.size, "GPT-2's attention heads (n_head)")
    # typeshed's Hashable does not match type[Any]; `type(...)`'s result is typed plain `type`.
    cls = _head_parallel_class(type(attention))  # type: ignore[arg-type]
    local = cls.__new__(cls)  # type: ignore[call-overload]
    nn.Module.__init__(local)
    for key, value in vars(attention).items():
        if not key.startswith("_"):  # plain attributes (config, head_dim, scaling, layer_idx, training, ...)
            setattr(local, key, value)
    for name, child in attention.named_children():  # in order: the same state_dict() key order
        if name == "c_attn":
            child = ColumnParallelConv1D(child, region, fused=(embed_dim,) * 3, sequence_parallel=sequence_parallel)
        elif name == "c_proj":
            child = RowParallelConv1D(child, region, sequence_parallel=sequence_parallel)
        local.register_module(name, child)
    local.num_heads, local.split_size = num_local_heads, embed_dim // region.size
    return local
