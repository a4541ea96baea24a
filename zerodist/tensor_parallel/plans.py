"""Built-in plans: the demo GPT (`zerodist.models.gpt`) and Hugging Face Llama-style models.

The demo GPT's attention reshapes its fused QKV output with the *global* head count
(`view(batch, seq, 3, self.n_heads, d_model // self.n_heads)`), which a column-parallel QKV
cannot satisfy, so its plan replaces each attention module with `HeadParallelAttention`: the same
submodule names (`qkv`, `proj`, `resid_dropout`, so the same `state_dict()` keys), this rank's
heads only. Everything else in the GPT stays as written.

A Hugging Face Llama computes its head count from the projection's output
(`view(*input_shape, -1, self.head_dim)`), so the column/row swaps alone parallelize it: its own
`config.base_model_tp_plan` is used, plus the vocab-parallel embedding and a gathered LM head.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.comm.topology import Topology
from zerodist.tensor_parallel.domino import DominoConfig, ResidualBranch, apply_domino
from zerodist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from zerodist.tensor_parallel.operators import TensorRegion, check_divisible
from zerodist.tensor_parallel.plan import PlanEntry, Replace
from zerodist.tensor_parallel.random import RNGTracker


class HeadParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads: QKV column-parallel (fused, each of q, k, v
    split by heads), the output projection row-parallel. Built from a demo-GPT attention."""

    def __init__(self, attention: nn.Module, region: TensorRegion, sequence_parallel: bool,
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

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention output, (batch, seq, d_model / t), before the projection."""
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.view(batch, seq, 3, self.num_local_heads, -1).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p and self.rng is not None:
            with self.rng.fork("sharded"):  # different heads: different masks on each rank
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return y.transpose(1, 2).reshape(batch, seq, -1)

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


def _build_attention(module: nn.Module, region: TensorRegion, sequence_parallel: bool,
                     rng: RNGTracker | None) -> HeadParallelAttention:
    return HeadParallelAttention(module, region, sequence_parallel, rng)


def gpt_block_branches(block: nn.Module) -> list[ResidualBranch]:
    """The demo GPT block's two residual branches, after `gpt_plan` (head-parallel attention; MLP
    with column `fc_in` and row `fc_out`), for the Domino schedule."""
    attn, mlp = block.attn, block.mlp
    return [
        ResidualBranch(lambda x: attn.proj.partial(attn.attend(block.ln_1(x))),
                       lambda y: attn.resid_dropout(attn.proj.add_bias(y))),
        ResidualBranch(lambda x: mlp.fc_out.partial(mlp.act(mlp.fc_in(block.ln_2(x)))),
                       lambda y: mlp.dropout(mlp.fc_out.add_bias(y))),
    ]


def gpt_domino(model: nn.Module, topology: Topology, config: DominoConfig) -> nn.Module:
    """Run a `gpt_plan`-parallelized demo GPT's blocks with the Domino schedule (in place)."""
    apply_domino(model.blocks, gpt_block_branches, TensorRegion.of(topology), config)
    return model


def hf_llama_plan(model: nn.Module) -> dict[str, str | PlanEntry]:
    """The plan for a Hugging Face `LlamaForCausalLM`-like model: its config's
    `base_model_tp_plan` under `model.`, the embedding vocab-parallel, the LM head gathered."""
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        raise ValueError(f"{type(model).__name__} has no config.base_model_tp_plan; write the plan by hand")
    prefix = getattr(model, "base_model_prefix", "model")
    plan: dict[str, str | PlanEntry] = {f"{prefix}.{pattern}": _hf_word(word) for pattern, word in base.items()}
    plan[f"{prefix}.embed_tokens"] = "vocab"
    plan["lm_head"] = "colwise_rep"
    return plan


def _hf_word(word: str) -> str:
    # Hugging Face's plan words that mean ours; anything else is refused by parallelize.
    return {"colwise_rep": "colwise_rep", "local_colwise": "colwise", "local_rowwise": "rowwise"}.get(word, word)
