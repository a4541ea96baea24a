"""A plain Hugging Face Trainer script, as a user writes it: `TrainingArguments(deepspeed=CONFIG)` when a
config is given, DDP otherwise. Run by tests/integrations/test_as_deepspeed.py under
`zerodist run --as-deepspeed` (and without it for the DDP reference); writes rank 0's logged losses."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.hf_models import VOCAB, hf_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    settings = dict(output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=args.steps, max_grad_norm=1.0, learning_rate=1e-3, logging_steps=1, report_to=[],
                    save_strategy="no", seed=0, disable_tqdm=True, deepspeed=args.deepspeed)
    if not torch.cuda.is_available():
        # On a machine without GPUs accelerate's DeepSpeed path needs the backend named (it finds no device
        # type to pick one from); DDP on the CPU is use_cpu.
        settings.update(ddp_backend="gloo") if args.deepspeed else settings.update(use_cpu=True)
    training_args = transformers.TrainingArguments(**settings)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config("llama"))
    ids = torch.randint(0, VOCAB, (96, 16), generator=torch.Generator().manual_seed(1))
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    trainer.save_model(args.out + "/final")
    if training_args.process_index == 0:
        history = [h for h in trainer.state.log_history if "loss" in h]
        engine = type(trainer.model_wrapped)
        Path(args.out, "result.json").write_text(json.dumps({
            "losses": [h["loss"] for h in history], "grad_norms": [h["grad_norm"] for h in history],
            "lrs": [h["learning_rate"] for h in history], "engine": f"{engine.__module__}.{engine.__name__}"}))


if __name__ == "__main__":
    main()
