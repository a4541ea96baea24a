"""TRL's DPOTrainer with a reference model, unmodified, on 2 ranks: under DDP (no --stage) or with a
DeepSpeed config (ZeRO --stage), as `zerodist run --as-deepspeed` serves it (tests/integrations/test_trl_dpo.py).
TRL prepares the reference model itself (`prepare_deepspeed`: no optimizer; stage 0 unless 3, and at
stage 3 its dotted bucket keys). Writes OUT/result.json: the losses and what the reference model became."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab["<pad>"], vocab["<eos>"] = len(vocab), len(vocab) + 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=None)
    parser.add_argument("--sync-reference", action="store_true",
                        help="TRL's sync_ref_model: every 2 steps the reference moves halfway to the policy")
    args = parser.parse_args()
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    tokenizer = _tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    data = Dataset.from_list([{"prompt": f"q{i} ", "chosen": f"good {i}", "rejected": f"bad {i * 7}"} for i in range(32)])
    deepspeed = None if args.stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": args.stage}}
    training = DPOConfig(output_dir=args.out, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
                         logging_steps=1, deepspeed=deepspeed, report_to=[], save_strategy="no", use_cpu=True,
                         max_length=32, seed=0, dataloader_num_workers=0,
                         bf16=False,  # TRL's default is bf16 autocast under DDP and bf16 weights under DeepSpeed
                         sync_ref_model=args.sync_reference, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    trainer = DPOTrainer(model=model, ref_model=reference, args=training, train_dataset=data,
                         processing_class=tokenizer)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        zero = getattr(trainer.ref_model, "zero_state", None)
        wrapped = trainer.model_wrapped
        result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "model": f"{type(wrapped).__module__}.{type(wrapped).__name__}",
                  "reference": f"{type(trainer.ref_model).__module__}.{type(trainer.ref_model).__name__}",
                  "reference_stage": None if zero is None else trainer.ref_model.zero_optimization_stage()}
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
