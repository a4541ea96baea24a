"""Train a Hugging Face causal LM with ZeRO-3 on the corpus of `zerodist train`, then save_pretrained.

    zerodist run --nproc 2 examples/hf_causal_lm.py --model MODEL_DIR --out OUT [--steps 100]

MODEL_DIR is a local directory: a config.json alone (the model starts from its own
initialisation) or a `save_pretrained` checkpoint (its weights are loaded). No hub access.

- The model is built inside `zerodist.zero.Init()`: nothing is allocated until `initialize`
  materialises it one unit at a time, each rank keeping its shard, with exactly the values an
  eager build from the same seed would have (docs/huggingface.md).
- Pretrained weights go in with `zerodist.checkpoint.load_pretrained`: each rank reads only the
  slices it owns from the memory-mapped safetensors files.
- bf16 mixed precision, ZeRO stage 3, a checkpoint every --save-interval steps under OUT/checkpoints
  (a rerun resumes from the newest one), and at the end `OUT/hf`: a directory `from_pretrained`
  loads unchanged, gathered one unit at a time and written by rank 0.

The corpus is bytes (the standard library's Python sources), so the model's vocabulary must
hold at least 256 tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import zerodist
from zerodist.data import TokenDataset, split_corpus, stdlib_corpus


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory with config.json (and optionally weights)")
    parser.add_argument("--out", required=True, help="output directory: checkpoints/ and hf/")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train to (default 100)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--save-interval", type=int, default=50, help="checkpoint every N steps (0: never)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(model_dir: Path, seed: int) -> tuple[torch.nn.Module, bool]:
    """The model on the meta device (partitioned construction); True if weights are to be loaded."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if config.vocab_size < 256:
        raise SystemExit(f"{model_dir}: vocab_size {config.vocab_size} < 256; the byte corpus needs 256 tokens")
    has_weights = any((model_dir / name).is_file() for name in (
        "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"))
    torch.manual_seed(seed)
    with zerodist.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model, has_weights


def main() -> None:
    args = parse_args()
    model_dir, out = Path(args.model), Path(args.out)
    model, has_weights = build_model(model_dir, args.seed)
    train_tokens, _ = split_corpus(stdlib_corpus(args.corpus_bytes, seed=args.seed))
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": max(1, args.steps // 10)}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "checkpoint": {"save_dir": str(out / "checkpoints"), "save_interval": args.save_interval,
                       "auto_resume": True},
        "steps_per_print": 10,
    }
    engine, _, loader, _ = zerodist.initialize(model=model, config=config,
                                               training_data=TokenDataset(train_tokens, args.seq_len))
    if engine.global_steps == 0 and has_weights:  # not resumed from a checkpoint (auto_resume)
        zerodist.checkpoint.load_pretrained(engine, model_dir)
    engine.train()
    while engine.global_steps < args.steps:
        for inputs, targets in loader:
            logits = engine(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.steps:
                break
    zerodist.checkpoint.save_pretrained(engine, out / "hf")
    if zerodist.comm.get_rank() == 0:
        print(f"trained to step {engine.global_steps}; from_pretrained('{out / 'hf'}') loads the result", flush=True)


if __name__ == "__main__":
    main()
