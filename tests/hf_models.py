"""Tiny Hugging Face models for the tests, built from local configs (no hub access)."""

from __future__ import annotations

from typing import Any

import torch

KINDS = ("gpt2", "llama", "bert")
VOCAB, SEQ = 96, 16


def hf_config(kind: str, **overrides: Any) -> Any:
    """A tiny config of `kind`, dropout off (so that ranks and the reference agree)."""
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
    elif kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    elif kind == "mixtral":  # a mixture of experts: router and per-expert weights
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                            bos_token_id=0, eos_token_id=0)
    elif kind == "bert":
        config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"  # the same kernels everywhere
    return config


# Llama-like decoders small_hf_model builds as it builds Llama: (model class, config class, extra config);
# Gemma 2 is post-norm (post_attention_layernorm / post_feedforward_layernorm after each row layer),
# Mixtral's blocks end in a mixture of experts (4 experts, top 2)
LLAMA_LIKE = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}),
              "mistral": ("MistralForCausalLM", "MistralConfig", {}),
              "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
              "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
              "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 4, "attn_implementation": "eager",
                                                                      "pad_token_id": None})}


def small_hf_model(kind: str, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    """A 16-wide HF Llama, Mistral, Qwen2, Mixtral or Gemma 2 (4 query / 2 key-value heads) or GPT-2 (2 heads)
    of `layers` blocks, untied, dropout off, seeded: the tensor-parallel tests' models (heads a tensor
    degree of 2 divides)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind in LLAMA_LIKE:
        model_class, config_class, extra = LLAMA_LIKE[kind]
        return getattr(transformers, model_class)(getattr(transformers, config_class)(
            vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=seq, tie_word_embeddings=False, **extra))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=16, n_layer=layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def hf_class(kind: str) -> type:
    import transformers

    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
            "bert": transformers.BertForMaskedLM, "mixtral": transformers.MixtralForCausalLM}[kind]


def hf_batch(step: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=generator)


def hf_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Language-model loss (labels = inputs; HF shifts them for causal models, BERT predicts all)."""
    return model(input_ids=ids, labels=ids).loss


def tied_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """Names of parameters that are the same object, as (first name, other name)."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((first[id(param)], name))
        else:
            first[id(param)] = name
    return pairs
