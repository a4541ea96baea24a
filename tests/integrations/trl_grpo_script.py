"""TRL's GRPOTrainer, unmodified, on 2 ranks: under DDP (no --stage) or with a DeepSpeed config (ZeRO
--stage), as `zerodist run --as-deepspeed` serves it (tests/integrations/test_trl_grpo.py). It samples
completions with the policy (at ZeRO-3 inside TRL's whole-model gather), scores them with a reward
function and keeps a reference model (beta > 0) that TRL prepares itself. Writes OUT/result.json."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from tests.integrations.trl_dpo_script import _tokenizer


def _reward(completions: list[str], **_: object) -> list[float]:
    return [len(completion) / 8 for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=None)
    args = parser.parse_args()
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = _tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model_dir = Path(args.out, f"model-rank{os.environ.get('RANK', '0')}")  # GRPO builds its reference from a path
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    deepspeed = None if args.stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": args.stage}}
    training = GRPOConfig(output_dir=args.out, per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                          max_steps=3, learning_rate=1e-3, logging_steps=1, deepspeed=deepspeed, report_to=[],
                          save_strategy="no", use_cpu=True, seed=0, bf16=False, beta=0.04, dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": f"q{i} "} for i in range(16)])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward, args=training, train_dataset=data,
                          processing_class=tokenizer)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = [h for h in trainer.state.log_history if "loss" in h]
        result = {"losses": [h["loss"] for h in logged], "rewards": [h["reward"] for h in logged],
                  "model": f"{type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__name__}",
                  "reference": f"{type(trainer.ref_model).__module__}.{type(trainer.ref_model).__name__}"}
        Path(args.out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
