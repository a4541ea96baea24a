"""What the TRL scripts (trl_dpo_script.py, trl_grpo_script.py, trl_sft_lora_script.py) share: a
character-level tokenizer, a tiny Llama's config, the command line, and the DeepSpeed config of a ZeRO
stage (None: DDP); and how their tests launch them (`launch`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


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


def finish() -> None:
    """End the run's process group before the interpreter exits: a rank left to tear gloo down at exit
    sometimes aborts ("terminate called without an active exception"), failing a run that trained."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def deepspeed_config(stage: int | None) -> dict[str, Any] | None:
    return None if stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}


def type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__name__}"


def launch(script: str, out: Path, stage: int | None, *extra: str) -> dict[str, Any]:
    """Run tests/integrations/`script` on 2 ranks, under DDP (`stage` None) or served as DeepSpeed at
    ZeRO `stage` (`zerodist run --as-deepspeed`); returns the OUT/result.json it writes."""
    from tests.processes import run_group

    args = [sys.executable, "-m", "zerodist", "run", *(["--as-deepspeed"] if stage is not None else []),
            "--nproc", "2", str(REPO / "tests" / "integrations" / script), "--out", str(out),
            *(["--stage", str(stage)] if stage is not None else []), *extra]
    result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "result.json").read_text())
