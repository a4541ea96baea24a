"""The demo GPT as a list of pipeline layers (DeepSpeed's `GPT2ModelPipe` pattern, without a class
name meaning anything): embedding, blocks, final LayerNorm, and a head that reuses the token
embedding's weight through a `TiedLayerSpec`, so the first and last stages hold tied copies.

    layers = gpt_pipeline_layers(GPTConfig(...))
    model = PipelineModule(layers, num_stages=2, loss_fn=gpt_loss, seed_layers=True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.models.gpt import Block, GPTConfig, InitEmbedding
from zerodist.pipe import LayerSpec, TiedLayerSpec

__all__ = ["Embeddings", "gpt_loss", "gpt_pipeline_layers"]


class Embeddings(nn.Module):
    """Token plus position embeddings: token ids (batch, seq) -> (batch, seq, d_model)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = InitEmbedding(config.vocab_size, config.d_model)
        self.pos_emb = InitEmbedding(config.seq_len, config.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx.long()) + self.pos_emb(positions)


def _head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embeddings.tok_emb.weight)  # logits with the tied token embedding


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def gpt_pipeline_layers(config: GPTConfig) -> list[LayerSpec]:
    """Embeddings (tied), `n_layers` blocks, LayerNorm, head (tied to the token embedding)."""
    return [
        TiedLayerSpec("embed", Embeddings, config, tied_weight_attr="tok_emb.weight"),
        *(LayerSpec(Block, config) for _ in range(config.n_layers)),
        LayerSpec(nn.LayerNorm, config.d_model),
        TiedLayerSpec("embed", Embeddings, config, forward_fn=_head, tied_weight_attr="tok_emb.weight"),
    ]
