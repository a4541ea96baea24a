"""TRL's SFTTrainer with a PEFT LoRA adapter (`peft_config=`), unmodified, on 2 ranks: under DDP (no
--stage) or with a DeepSpeed config (ZeRO --stage), as `zerodist run --as-deepspeed` serves it
(tests/integrations/test_trl_sft_lora.py). Writes OUT/result.json: the losses and, under zerodist, how
much of the frozen base model this rank holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tests.integrations.trl_common import arguments, deepspeed_config, finish, tiny_llama_config, tokenizer, type_name


def main() -> None:
    args = arguments()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokens = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokens))
    data = Dataset.from_list([{"text": f"question {i}: answer {i * 7 % 13}"} for i in range(32)])
    ds_config = deepspeed_config(args.stage)
    if ds_config is not None:  # every weight of the tiny model is under the default threshold (1e5 elements)
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    training = SFTConfig(output_dir=args.out, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                         logging_steps=1, deepspeed=ds_config, report_to=[], save_strategy="no",
                         use_cpu=True, max_length=32, seed=0, dataloader_num_workers=0, bf16=False,
                         gradient_checkpointing=True)  # PEFT's usual pairing: reentrant, inputs made to need grad
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=training, train_dataset=data, processing_class=tokens, peft_config=lora)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        zero = getattr(trainer.model_wrapped, "zero_state", None)
        frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
        held = None if zero is None else sum(g.param_shard.numel() for g in zero.frozen_groups)
        result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "model": type_name(trainer.model_wrapped), "frozen": sum(p.numel() for p in frozen),
                  "frozen_held": held, "frozen_groups": None if zero is None else len(zero.frozen_groups)}
        Path(args.out, "result.json").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    main()
