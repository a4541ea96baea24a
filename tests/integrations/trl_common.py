"""What the TRL scripts (trl_dpo_script.py, trl_grpo_script.py) share: a character-level tokenizer, a tiny
Llama's config, the command line, and the DeepSpeed config of a ZeRO stage (None: DDP)."""

from __future__ import annotations

import argparse
from typing import Any


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab["<pad>"], vocab["<eos>"] = len(vocab), len(vocab) + 1
    built = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    built.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=built, pad_token="<pad>", eos_token="<eos>")


def tiny_llama_config(tokens: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       pad_token_id=tokens.pad_token_id, eos_token_id=tokens.eos_token_id)


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=None, help="ZeRO stage through DeepSpeed's config (none: DDP)")
    return parser.parse_args()


def deepspeed_config(stage: int | None) -> dict[str, Any] | None:
    return None if stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}


def type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__name__}"
