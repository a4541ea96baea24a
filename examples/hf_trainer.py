"""Hugging Face's Trainer driving zerodist, with a DeepSpeed config template as LLaMA-Factory ships it.

    zerodist run --nproc 2 examples/hf_trainer.py --out OUT [--stage 3] [--steps 20]

Needs `pip install 'zerodist[hf]'` (transformers and accelerate). A small Llama is built from a
config (no download) and trained on the byte corpus of `zerodist train` by
`ZerodistTrainer`, a `transformers.Trainer` whose steps the zerodist engine runs. The config is
LLaMA-Factory's `ds_z{stage}_config.json`, `"auto"` everywhere: batch sizes, clipping and
precision are filled from the `TrainingArguments`, bucket sizes from the model's hidden size, as
the Trainer fills them for DeepSpeed. At the end `OUT/final` is a directory `from_pretrained` loads.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from zerodist.data import TokenDataset, stdlib_corpus
from zerodist.integrations.transformers import ZerodistTrainer

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json (Apache-2.0); ds_z2 differs in its zero section.
TEMPLATE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


class CausalLMBytes(torch.utils.data.Dataset):
    """The corpus cut into sequences, as the dicts a causal LM's Trainer reads."""

    def __init__(self, tokens: TokenDataset) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, _ = self.tokens[index]
        return {"input_ids": inputs, "labels": inputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    data = CausalLMBytes(TokenDataset(stdlib_corpus(max_bytes=400_000), seq_len=64))
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=5, use_cpu=True, report_to=[],
        save_strategy="steps", save_steps=10, seed=0, disable_tqdm=True)
    ds_config = {**TEMPLATE, "zero_optimization": {**TEMPLATE["zero_optimization"], "stage": args.stage}}
    trainer = ZerodistTrainer(model=model, args=training, train_dataset=data, config=ds_config)
    trainer.train()
    trainer.save_model(f"{args.out}/final")
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"trained {trainer.state.global_step} steps as {type(trainer.model_wrapped).__name__} "
              f"(ZeRO {args.stage}); logged losses {losses}; from_pretrained('{args.out}/final')")


if __name__ == "__main__":
    main()
