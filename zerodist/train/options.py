"""What one `zerodist train` run does: built-in defaults, then the `--config` file, then flags.

Pure dict arithmetic (no torch, no process group), so the launcher can validate the whole
config before it spawns a single rank: a bad file is one clear line, not N tracebacks.

Precedence, lowest first:
1. the built-in defaults below (ZeRO-2, AdamW, warm-up + cosine schedule, clipping 1.0);
2. the `--config` file: each top-level section it names replaces the default section whole
   (a file's `optimizer` never inherits AdamW's betas), and naming any batch key drops the
   default batch keys;
3. the flags (`--stage`, `--micro-batch`, `--lr`, `--bf16`/`--fp16`, `--steps`, `--tp`, `--domino`, `--sp`,
   `--sp-method`), one
   value each.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

DEFAULT_MODEL = "small"
DEFAULT_STEPS = 300
DEFAULT_STAGE = 2
DEFAULT_MICRO_BATCH = 8
DEFAULT_LR = 3e-3
DEFAULT_SEED = 0
# Enough windows that 300 steps at 2 x 8 x 128 tokens stay within one epoch, read in ~0.1 s.
CORPUS_BYTES = 4_000_000


# Where rank 0's lines that belong before or during the run go (the header, a pipeline's step
# losses): the CLI passes a function that prints them; the library itself never prints.
Progress = Callable[[str], None]


@dataclasses.dataclass
class TrainOutcome:
    """What one `train(plan)` call reports, for the CLI to show: the exit `code`; rank 0's `lines`
    for stdout after the run (the summary, its sections, the files written, what went wrong) and
    `errors` for stderr, each entry printed as one `print` (entries may hold newlines); empty on the
    other ranks. `summary`: the plain demo's `RunSummary` (zerodist/train/report.py), else None."""

    code: int
    lines: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    summary: Any = None


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The flags a user passed; None means "not given" (the file or default stands)."""

    stage: int | None = None
    micro_batch: int | None = None
    lr: float | None = None
    steps: int | None = None
    bf16: bool = False
    fp16: bool = False
    save_interval: int | None = None  # checkpoint every N steps into save_dir
    resume: bool = False  # continue from the newest checkpoint in save_dir
    keep_last: int | None = None  # --keep-last: checkpoint.keep_last (only the newest N kept)
    save_dir: str | None = None  # set by the CLI from --out; a file's checkpoint.save_dir wins
    tensor_parallel: int | None = None  # --tp: tensor_parallel.autotp_size
    domino_chunks: int | None = None  # --domino: zerodist.tensor_parallel.domino.chunks (inter-layer overlap)
    sequence_parallel: int | None = None  # --sp: sequence_parallel_size
    sequence_method: str | None = None  # --sp-method: zerodist.sequence_parallel.method
    moe: bool = False  # --moe given (Domino's overlap is then "intra")


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Everything a rank needs to train; identical on every rank."""

    model: str
    steps: int
    seed: int
    out: Path
    config: dict[str, Any]
    corpus_bytes: int = CORPUS_BYTES
    moe_experts: int = 0  # > 0: every block's MLP is an MoE layer of this many experts, expert parallel
    expert_degree: int = 1  # the expert-parallel ranks the experts are spread over (with moe_experts)
    seq_len: int | None = None  # --seq-len: the GPT's sequence length (None: the preset's)
    pipe: int = 1  # > 1: the GPT cut into this many pipeline stages by split_model (zerodist/train/loop.py)
    pipe_schedule: str = "1f1b"


def default_config(steps: int) -> dict[str, Any]:
    """The DeepSpeed-style config `zerodist train` uses when no file says otherwise."""
    return {
        "train_micro_batch_size_per_gpu": DEFAULT_MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": DEFAULT_LR, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": cosine_schedule(steps)},
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "zero_optimization": {"stage": DEFAULT_STAGE},
    }


def cosine_schedule(steps: int) -> dict[str, Any]:
    # A short linear warm-up (10% of the run) keeps the first AdamW steps, whose second-moment
    # estimates are still tiny, from overshooting at lr 3e-3; the cosine then ends at 10%.
    return {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 10), "warmup_type": "linear",
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}


def merge_config(file_config: dict[str, Any] | None, overrides: Overrides, steps: int) -> dict[str, Any]:
    """Defaults, then the file's sections, then the flags (see the module docstring)."""
    config = default_config(steps)
    if file_config:
        if any(key in file_config for key in BATCH_KEYS):
            for key in BATCH_KEYS:
                config.pop(key, None)
        config.update(copy.deepcopy(file_config))
    apply_overrides(config, overrides)
    return config


def apply_overrides(config: dict[str, Any], overrides: Overrides) -> None:
    """Set each given flag's value in `config`. A section of the wrong type (a file's
    `"optimizer": 3`) is left alone for the config validation to name."""
    if overrides.stage is not None:
        _section(config, "zero_optimization", {})["stage"] = overrides.stage
    if overrides.micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = overrides.micro_batch
        # The train size follows from micro x accumulation x ranks; a stale one would contradict it.
        config.pop("train_batch_size", None)
    if overrides.lr is not None:
        _section(_section(config, "optimizer", {"type": "AdamW"}), "params", {})["lr"] = overrides.lr
        schedule = _scheduler_params(config)
        if "warmup_max_lr" in schedule:  # WarmupLR / WarmupDecayLR peak at this, not at the optimizer's lr
            schedule["warmup_max_lr"] = overrides.lr
    if overrides.steps is not None and "total_num_steps" in _scheduler_params(config):
        _scheduler_params(config)["total_num_steps"] = overrides.steps
    if overrides.save_interval is not None or overrides.resume or overrides.keep_last is not None:
        checkpoint = _section(config, "checkpoint", {})
        checkpoint.setdefault("save_dir", overrides.save_dir)
        if overrides.save_interval is not None:
            checkpoint["save_interval"] = overrides.save_interval
        if overrides.keep_last is not None:
            checkpoint["keep_last"] = overrides.keep_last
        checkpoint["auto_resume"] = overrides.resume or checkpoint.get("auto_resume", False)
    if overrides.tensor_parallel is not None:
        _section(config, "tensor_parallel", {})["autotp_size"] = overrides.tensor_parallel
    if overrides.domino_chunks is not None:
        zerodist_tp = _section(_section(config, "zerodist", {}), "tensor_parallel", {})
        # the MoE demo's blocks return (hidden, balance loss): each block joins its chunks ("intra")
        zerodist_tp["domino"] = {"chunks": overrides.domino_chunks, "overlap": "intra" if overrides.moe else "inter"}
    if overrides.sequence_parallel is not None:
        config["sequence_parallel_size"] = overrides.sequence_parallel
    if overrides.sequence_method is not None:
        _section(_section(config, "zerodist", {}), "sequence_parallel", {})["method"] = overrides.sequence_method
    if overrides.bf16 or overrides.fp16:
        _section(config, "bf16", {})["enabled"] = overrides.bf16
        _section(config, "fp16", {})["enabled"] = overrides.fp16


def _section(config: dict[str, Any], key: str, default: dict[str, Any]) -> dict[str, Any]:
    """`config[key]`, created from `default` when absent; a throwaway dict when it is not a dict."""
    value = config.setdefault(key, default)
    return value if isinstance(value, dict) else {}


def _scheduler_params(config: dict[str, Any]) -> dict[str, Any]:
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict):
        return {}
    return _section(scheduler, "params", {})
