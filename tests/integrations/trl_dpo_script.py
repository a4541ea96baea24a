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

from tests.integrations.trl_common import arguments, deepspeed_config, finish, tiny_llama_config, tokenizer, type_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync-reference", action="store_true",
                        help="TRL's sync_ref_model: every 2 steps the reference moves halfway to the policy")
    args = arguments(parser)
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    tokens = tokenizer()
    config = tiny_llama_config(tokens)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    data = Dataset.from_list([{"prompt": f"q{i} ", "chosen": f"good {i}", "rejected": f"bad {i * 7}"} for i in range(32)])
    training = DPOConfig(output_dir=args.out, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
                         logging_steps=1, deepspeed=deepspeed_config(args.stage), report_to=[], save_strategy="no",
                         use_cpu=True, max_length=32, seed=0, dataloader_num_workers=0,
                         bf16=False,  # TRL's default is bf16 autocast under DDP and bf16 weights under DeepSpeed
                         sync_ref_model=args.sync_reference, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    trainer = DPOTrainer(model=model, ref_model=reference, args=training, train_dataset=data,
                         processing_class=tokens)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        zero = getattr(trainer.ref_model, "zero_state", None)
        result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "model": type_name(trainer.model_wrapped), "reference": type_name(trainer.ref_model),
                  "reference_stage": None if zero is None else trainer.ref_model.zero_optimization_stage()}
        Path(args.out, "result.json").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    main()
