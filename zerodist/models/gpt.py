"""A small decoder-only transformer (GPT-2 shape, pre-LayerNorm), byte-level by default.

Layout matters to the layers that wrap it: the transformer blocks live in ``GPT.blocks``
(an ``nn.ModuleList``) so ZeRO-3 can gather and free one block at a time, and every matmul is
a named ``nn.Linear`` (``attn.qkv``, ``attn.proj``, ``mlp.fc_in``, ``mlp.fc_out``) so tensor
parallelism can swap them for column/row parallel layers by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.models.toy import count_parameters
from zerodist.sequence.layer import DistributedAttention


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``d_ff=None`` means ``4 * d_model`` (resolved at construction)."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.d_ff is None:
            # Frozen: resolving the default once keeps every reader (and the repr) on one number.
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        elif not isinstance(self.d_ff, int) or self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff must be a positive int or None, got {self.d_ff!r}")


# "small" is the default config (about 0.88M parameters); "bench" is an alias kept separate so
# benchmark numbers stay comparable if the demo default ever changes.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2),
    "small": GPTConfig(),
    "bench": GPTConfig(),
    "bench-25m": GPTConfig(d_model=512, n_layers=8, n_heads=8),
}


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` ("tiny", "small", "bench", "bench-25m"), with optional field overrides."""
    if name not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of: {', '.join(GPT_PRESETS)}")
    return dataclasses.replace(GPT_PRESETS[name], **overrides)


class InitLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters()`` is the GPT-2 init, N(0, std) and zero bias.

    [Note: per-module init] Every random draw of the GPT's initialisation happens inside some
    module's own ``reset_parameters()``, called by that module's constructor, in construction
    (= ``modules()``) order. Replaying those calls in that order from the same RNG state gives
    the same values, which is how a model put on the meta device by other means is materialised
    one unit at a time. (``zerodist.zero.Init`` needs no such convention: it records and replays
    whatever the initialisation did; see [Note: recorded init] in zerodist/zero/replay_init.py.)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, std: float = 0.02) -> None:
        self.std = std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02) (see [Note: per-module init])."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def _residual_std(config: GPTConfig) -> float:
    # Projections that write into the residual stream: variance must not grow with depth.
    return 0.02 / math.sqrt(2 * config.n_layers)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal scaled-dot-product attention over (batch, heads, seq, head_dim)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over (batch, seq, d_model).

    The attention itself runs in `core`, a `zerodist.sequence.DistributedAttention` with no group:
    plain causal attention on one process, and sequence-parallel (Ulysses or ring) once
    `zerodist.initialize()` runs with `sequence_parallel_size` > 1 (it has no parameters, so the
    state dict is unchanged)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = InitLinear(config.d_model, 3 * config.d_model)
        self.proj = InitLinear(config.d_model, config.d_model, std=_residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)
        # (batch, heads, seq, head_dim): heads are dimension 1, the sequence dimension 2
        self.core = DistributedAttention(causal_attention, None, scatter_idx=1, gather_idx=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        y = self.core(q, k, v, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Linear -> GELU -> Linear, d_model -> d_ff -> d_model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.d_ff is not None  # resolved by GPTConfig.__post_init__
        self.fc_in = InitLinear(config.d_model, config.d_ff)
        self.act = nn.GELU()
        self.fc_out = InitLinear(config.d_ff, config.d_model, std=_residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx)`` -> logits (B, T, vocab);
    ``forward(idx, targets)`` -> mean cross-entropy loss (a scalar, targets -100 ignored), as a
    training loop wants. ``position_ids`` (B, T) number the tokens (default 0..T-1): a
    sequence-parallel rank holds a slice of the sequence and passes the slice's positions."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        c = self.config
        self.tok_emb = InitEmbedding(c.vocab_size, c.d_model)
        self.pos_emb = InitEmbedding(c.seq_len, c.d_model)
        self.emb_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = InitLinear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every weight: GPT-2 init (see [Note: per-module init]); LayerNorm (1, 0)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()  # type: ignore[operator]  # nn.Module.__getattr__ is typed Tensor | Module

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len={self.config.seq_len}")
        idx = idx.long()
        positions = torch.arange(seq, device=idx.device) if position_ids is None else position_ids.long()
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return count_parameters(self)
