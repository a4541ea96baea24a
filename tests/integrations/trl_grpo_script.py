"""TRL's GRPOTrainer, unmodified, on 2 ranks: under DDP (no --stage) or with a DeepSpeed config (ZeRO
--stage), as `zerodist run --as-deepspeed` serves it (tests/integrations/test_trl_grpo.py). It samples
completions with the policy (at ZeRO-3 inside TRL's whole-model gather), scores them with a reward
function and keeps a reference model (beta > 0) that TRL prepares itself. Writes OUT/result.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tests.integrations.trl_common import arguments, deepspeed_config, finish, tiny_llama_config, tokenizer, type_name


def _reward(completions: list[str], **_: object) -> list[float]:
    return [len(completion) / 8 for completion in completions]


def main() -> None:
    args = arguments()
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tokens = tokenizer()
    config = tiny_llama_config(tokens)
    torch.manual_seed(0)
    model_dir = Path(args.out, f"model-rank{os.environ.get('RANK', '0')}")  # GRPO builds its reference from a path
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokens.save_pretrained(model_dir)
    training = GRPOConfig(output_dir=args.out, per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=8, max_steps=3, learning_rate=1e-3, logging_steps=1,
                          deepspeed=deepspeed_config(args.stage), report_to=[], save_strategy="no", use_cpu=True,
                          seed=0, bf16=False, beta=0.04, dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": f"q{i} "} for i in range(16)])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward, args=training, train_dataset=data,
                          processing_class=tokens)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = [h for h in trainer.state.log_history if "loss" in h]
        result = {"losses": [h["loss"] for h in logged], "rewards": [h["reward"] for h in logged],
                  "model": type_name(trainer.model_wrapped), "reference": type_name(trainer.ref_model)}
        Path(args.out, "result.json").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    main()
