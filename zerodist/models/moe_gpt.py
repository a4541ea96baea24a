"""The demo GPT with mixture-of-experts blocks: every `moe_every`-th block's MLP becomes a
`zerodist.moe.layer.MoE` whose experts are copies of that MLP (DeepSpeed's convention: experts
start equal and the gate's routing makes them differ).

`MoEGPT.forward(idx, targets)` returns the cross-entropy plus `aux_loss_coef` times the sum of the
MoE layers' `l_aux`, the way a DeepSpeed MoE script adds it. Unlike `zerodist.models.gpt`, this
module imports `zerodist.moe` (the layer it demonstrates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.models.gpt import GPTConfig, CausalSelfAttention, InitEmbedding, InitLinear, MLP, gpt_config
from zerodist.models.toy import count_parameters
from zerodist.moe.layer import MoE


@dataclass(frozen=True)
class MoEConfig:
    """The MoE blocks of a `MoEGPT`: `MoE(...)` arguments plus where the layers go."""

    num_experts: int = 4
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = False
    top2_2nd_expert_sampling: bool = False
    noisy_gate_policy: str | None = None
    moe_every: int = 1
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.moe_every, int) or self.moe_every < 1:
            raise ValueError(f"MoEConfig.moe_every must be a positive int, got {self.moe_every!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")

    def layer_options(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("moe_every", "aux_loss_coef")}


class MoEBlock(nn.Module):
    """Pre-LayerNorm block whose MLP is an MoE layer: `x + attn(ln_1(x))`, then `x + moe(ln_2(x))`."""

    def __init__(self, config: GPTConfig, moe: MoEConfig, moe_class: type[nn.Module] = MoE) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.moe = moe_class(config.d_model, MLP(config), **moe.layer_options())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        output, l_aux, _ = self.moe(self.ln_2(x))
        return x + output, l_aux


class DenseBlock(nn.Module):
    """The plain GPT block, returning a zero aux loss so every block has one signature."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x)), x.new_zeros((), dtype=torch.float32)


class MoEGPT(nn.Module):
    """Decoder-only transformer with MoE blocks (blocks i with i % moe_every == moe_every - 1).
    `moe_class` builds the MoE layers: zerodist's `MoE` by default, or any class with DeepSpeed's
    signature (the benchmark passes `deepspeed.moe.layer.MoE` to build the same model)."""

    def __init__(self, config: GPTConfig | None = None, moe: MoEConfig | None = None,
                 moe_class: type[nn.Module] = MoE) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.moe_config = moe or MoEConfig()
        c, every = self.config, self.moe_config.moe_every
        self.tok_emb = InitEmbedding(c.vocab_size, c.d_model)
        self.pos_emb = InitEmbedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(MoEBlock(c, self.moe_config, moe_class) if i % every == every - 1 else DenseBlock(c)
                                    for i in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = InitLinear(c.d_model, c.vocab_size, bias=False)

    def moe_layers(self) -> list[nn.Module]:
        return [block.moe for block in self.blocks if isinstance(block, MoEBlock)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` as `GPT.forward`'s: a sequence-parallel rank passes its slice's positions."""
        if idx.dim() != 2 or idx.shape[1] > self.config.seq_len:
            raise ValueError(f"MoEGPT expects token ids (batch, seq <= {self.config.seq_len}), got {tuple(idx.shape)}")
        positions = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids.long()
        x = self.tok_emb(idx.long()) + self.pos_emb(positions)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())
        return loss + self.moe_config.aux_loss_coef * aux

    def num_parameters(self) -> int:
        return count_parameters(self)


def moe_gpt(preset: str = "tiny", moe: MoEConfig | None = None, **overrides: object) -> MoEGPT:
    """A `MoEGPT` on the GPT preset `preset` (see `zerodist.models.gpt.GPT_PRESETS`)."""
    return MoEGPT(gpt_config(preset, **overrides), moe)
