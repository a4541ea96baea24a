"""`zerodist train`: a small byte-level GPT trained with ZeRO on the standard library's sources.

With no arguments: 2 ranks on a CPU machine (one per GPU where there are GPUs), ZeRO stage 2,
300 steps, about two minutes on 2 CPU cores. It launches its ranks through the elastic agent
(torchrun); under `zerodist run` or torchrun (RANK set) it trains in place. `--nproc 1` trains
in this process. For many nodes: `zerodist run --nnodes ... -m zerodist train ...`.

Rank 0 shows a progress bar, prints a summary (loss, tokens/s, model-state bytes per rank
beside docs/design/zero.md's ZeRO formula, bytes per collective, FLOPs and MFU) and writes metrics.csv,
loss.png, config.json and summary.txt to --out. `--trace` records a step of every rank into
OUT/timeline/ (docs/timeline.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a small GPT with ZeRO on the stdlib corpus (the demo)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="DeepSpeed JSON config; its sections replace the built-in defaults, flags override it")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default 2)")
    p.add_argument("--nproc", type=int, default=None, help="ranks on this machine (default: GPUs, or 2 on CPU)")
    p.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 300)")
    p.add_argument("--model", default=None, help="GPT preset: tiny, small, bench, bench-25m (default small)")
    p.add_argument("--micro-batch", type=_positive_int, default=None, help="sequences per rank per micro-step (default 8)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 parameters and gradients, fp32 master weights")
    precision.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    p.add_argument("--moe", type=_positive_int, default=None, metavar="N",
                   help="MoE demo: every block's MLP becomes N experts, expert parallel over nproc / (T x P x pipe) "
                        "ranks; composes with --tp (experts replicated over tensor), --sp, --pp and --domino")
    p.add_argument("--seed", type=int, default=None, help="model and corpus seed (default 0)")
    p.add_argument("--out", default=None, help="output folder (default runs/train-<timestamp>)")
    p.add_argument("--save-interval", type=_positive_int, default=None, metavar="N",
                   help="save a checkpoint every N steps in OUT/checkpoints")
    p.add_argument("--keep-last", type=_positive_int, default=None, metavar="N",
                   help="keep only the newest N checkpoints in OUT/checkpoints (default: all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in OUT/checkpoints (give the earlier run's --out)")
    p.add_argument("--tp", type=_positive_int, default=None, metavar="T",
                   help="tensor-parallel degree (ranks per tensor group); the data degree is nproc / T")
    p.add_argument("--sp", type=_positive_int, default=None, metavar="P",
                   help="sequence-parallel degree (ranks that split each sequence); the data degree is nproc / (T x P)")
    p.add_argument("--sp-method", choices=("ulysses", "ring"), default=None,
                   help="sequence-parallel attention: ulysses (default; P must divide the heads) or ring (any P)")
    p.add_argument("--seq-len", type=_positive_int, default=None, metavar="N",
                   help="the GPT's sequence length (default: the preset's)")
    p.add_argument("--domino", type=_positive_int, default=None, metavar="K",
                   help="Domino: split each block's batch into K >= 2 chunks to overlap tensor-parallel all-reduces")
    p.add_argument("--pp", type=_positive_int, default=None, metavar="P",
                   help="pipeline parallelism: the GPT cut into P stages by zerodist.pipe.split_model; composes "
                        "with --tp, --sp, --moe, --domino, checkpoints and --resume")
    p.add_argument("--schedule", default=None, choices=("gpipe", "1f1b", "interleaved", "zb"),
                   help="pipeline schedule with --pp (default 1f1b; interleaved puts 2 stages on each rank)")
    p.add_argument("--nnodes-sim", type=_positive_int, default=None, metavar="K",
                   help="run as K simulated nodes of nproc / K ranks (zerodist.simulated_nodes): the summary gives "
                        "bus bytes per step within and across nodes against docs/design/zero.md's formulas")
    p.add_argument("--trace", nargs="?", const="auto", default=None, metavar="STEP[:N]",
                   help="record a timeline of step STEP (default 2, or 1 for a one-step run) and N-1 after it on every "
                        "rank: OUT/timeline/timeline.json (merged, Chrome format) and traces/rank<r>.json (torch.profiler)")
    p.set_defaults(handler=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 2


def build_plan(args: argparse.Namespace, world_size: int) -> Any:
    """The plan every rank will run, validated now: raises ConfigError (or ValueError for the model)."""
    from zerodist.cli.layout_checks import check_layout_keys
    from zerodist.config import Config, ConfigError
    from zerodist.config.source import read_json_file
    from zerodist.engine.optimizers import optimizer_from_config
    from zerodist.engine.schedulers import scheduler_from_config
    from zerodist.models import GPT_PRESETS
    from zerodist.train import Overrides, TrainPlan, merge_config
    from zerodist.train.options import DEFAULT_MODEL, DEFAULT_SEED, DEFAULT_STEPS

    model = args.model or DEFAULT_MODEL
    if model not in GPT_PRESETS:
        raise ValueError(f"unknown --model {model!r}; choose one of: {', '.join(GPT_PRESETS)}")
    pipe = getattr(args, "pp", None) or 1  # absent from hand-made Namespaces
    schedule = getattr(args, "schedule", None) or "1f1b"
    _check_pipeline_flags(args, model, pipe, schedule, world_size)
    steps = args.steps or DEFAULT_STEPS
    file_config = read_json_file(Path(args.config)) if args.config else None
    out = Path(args.out or default_out()).resolve()
    overrides = Overrides(stage=args.stage, micro_batch=args.micro_batch, lr=args.lr, steps=args.steps,
                          bf16=args.bf16, fp16=args.fp16, save_interval=args.save_interval, resume=args.resume,
                          keep_last=getattr(args, "keep_last", None),  # absent from hand-made Namespaces
                          save_dir=str(out / "checkpoints"), tensor_parallel=args.tp, domino_chunks=args.domino,
                          sequence_parallel=getattr(args, "sp", None), sequence_method=getattr(args, "sp_method", None),
                          moe=args.moe is not None)
    config = merge_config(file_config, overrides, steps)
    if getattr(args, "trace", None):
        _enable_trace(config, args.trace, steps)
    nodes = getattr(args, "nnodes_sim", None)  # absent from hand-made Namespaces
    if nodes is not None:
        if world_size % nodes:
            raise ValueError(f"--nnodes-sim {nodes} does not divide --nproc {world_size}; choose a divisor")
        config.setdefault("zerodist", {})["simulated_nodes"] = nodes
    if pipe > 1:  # micro-batches to fill the pipe (2 per stage), and the schedule
        config["gradient_accumulation_steps"] = max(config.get("gradient_accumulation_steps") or 1, 2 * pipe)
        config.setdefault("zerodist", {})["pipeline"] = {"schedule": schedule,
                                                         "stages_per_rank": 2 if schedule == "interleaved" else 1}
    source = f"{args.config} with the command-line flags" if args.config else None
    try:
        checked = Config.load(config)
        tensor, sequence = checked.tensor_degree, checked.sequence_parallel_size
        if world_size % (tensor * sequence * pipe):
            raise ValueError(f"--nproc {world_size} is not divisible by the tensor-parallel degree {tensor} (--tp) x "
                             f"the sequence-parallel degree {sequence} (--sp) x the pipeline degree {pipe} (--pp)")
        _check_sequence(checked, model, getattr(args, "seq_len", None))
        batch = checked.batch_sizes(world_size // (tensor * sequence * pipe),
                                    world_size_source=f"{world_size} rank(s) / tensor {tensor} / sequence {sequence} "
                                                      f"/ pipe {pipe}")
        _check_domino(checked, batch.micro_batch_size, args.moe is not None)
        expert = world_size // (tensor * sequence * pipe) if args.moe else 1
        _check_experts(args.moe, expert, tensor, sequence, pipe)
        check_layout_keys(checked, world_size=world_size, tensor=tensor, sequence=sequence, pipe=pipe, expert=expert,
                          accumulation=batch.gradient_accumulation_steps)
        if checked.optimizer is not None:
            optimizer_from_config(checked)
        if checked.scheduler is not None:
            scheduler_from_config(checked)
    except ConfigError as err:
        raise ConfigError(err.problems, source=source) from None
    return TrainPlan(model=model, steps=steps, seed=DEFAULT_SEED if args.seed is None else args.seed, out=out,
                     config=config, moe_experts=args.moe or 0, expert_degree=expert, seq_len=getattr(args, "seq_len", None),
                     pipe=pipe, pipe_schedule=schedule)


def _check_pipeline_flags(args: argparse.Namespace, model: str, pipe: int, schedule: str, world_size: int) -> None:
    """--pp against the ranks and the preset's blocks."""
    if pipe > 1 and world_size % pipe:
        raise ValueError(f"--nproc {world_size} is not divisible by the pipeline degree {pipe} (--pp)")
    if pipe > 1:  # split_model gives each stage at least one block
        from zerodist.models import gpt_config

        stages, blocks = pipe * (2 if schedule == "interleaved" else 1), gpt_config(model).n_layers
        if stages > blocks:
            raise ValueError(f"--pp {pipe}{' --schedule interleaved (2 stages per rank)' if stages > pipe else ''}: "
                             f"{stages} pipeline stages for the {blocks} blocks of --model {model}; each stage needs "
                             "a block: use fewer stages or a larger --model (small has "
                             f"{gpt_config('small').n_layers} blocks)")


def _check_domino(config: Any, micro_batch: int, moe: bool) -> None:
    """Domino against the tensor degree, the micro-batch and --moe (the engine's own rules,
    zerodist/tensor_parallel/apply.py and domino.py, said before any rank starts: each rank would
    raise them at its first forward)."""
    domino = config.zerodist.tensor_parallel.domino
    if domino is None:
        return
    if config.tensor_degree == 1:
        raise ValueError(f"--domino {domino.chunks} overlaps the tensor-parallel all-reduces of a block's chunks; "
                         "it needs a tensor-parallel degree of 2 or more: add --tp 2")
    if micro_batch % domino.chunks:
        raise ValueError(f"Domino splits each micro-batch of {micro_batch} sample(s) into {domino.chunks} chunks; use "
                         f"a --micro-batch divisible by {domino.chunks} (or --domino a divisor of {micro_batch})")
    if moe and domino.overlap == "inter":
        raise ValueError('--moe with Domino\'s "overlap": "inter" (zerodist.tensor_parallel.domino in the config): '
                         "the MoE demo's blocks return (hidden states, balance loss), so each block must join its "
                         'chunks: set "overlap": "intra" (what --domino gives with --moe)')


def _check_experts(experts: int | None, degree: int, tensor: int, sequence: int, pipe: int) -> None:
    """--moe N: the experts are spread over the expert axis, the ranks of a stage that do not share a
    sample (nproc / (tensor x sequence x pipe), Megatron's folding of experts over data)."""
    if experts is not None and experts % degree:
        others = [f"{name} {value}" for name, value in (("tensor", tensor), ("sequence", sequence), ("pipe", pipe))
                  if value > 1]
        raise ValueError(f"--moe {experts}: the experts are spread over the {degree} expert-parallel rank(s) "
                         f"(nproc{' / ' + ' / '.join(others) if others else ''}), so their number must be a multiple "
                         f"of {degree}")


def _enable_trace(config: dict[str, Any], spec: str, steps: int) -> None:
    """`--trace [STEP[:N]]`: the `zerodist.timeline` section on (a file's settings kept where the flag says nothing)."""
    section = config.setdefault("zerodist", {}).setdefault("timeline", {})
    section["enabled"] = True
    if spec == "auto":
        section.setdefault("start_step", min(2, steps))
    else:
        first, _, count = spec.partition(":")
        if not first.isdigit() or (count and not count.isdigit()) or int(first) < 1:
            raise ValueError(f"--trace {spec!r}: give the first step to record and optionally how many, e.g. "
                             "--trace 2 or --trace 2:3")
        section["start_step"], section["num_steps"] = int(first), int(count or 1)
    end = section.get("start_step", 2) + section.get("num_steps", 1) - 1
    if isinstance(end, int) and end > steps:
        raise ValueError(f"--trace: step {end} is past the run's last step {steps}; record earlier steps or "
                         "raise --steps")


def _check_sequence(config: Any, model: str, seq_len: int | None) -> None:
    """Heads and sequence length against the sequence-parallel degree, before any rank starts."""
    from zerodist.models import gpt_config
    from zerodist.sequence.layout import SequenceLayout, check_heads

    gpt = gpt_config(model, **({"seq_len": seq_len} if seq_len else {}))
    degree, method, tensor = config.sequence_parallel_size, config.zerodist.sequence_parallel.method, config.tensor_degree
    if gpt.n_heads % tensor:
        raise ValueError(f"--tp {tensor}: tensor parallelism splits the {gpt.n_heads} attention heads of --model {model} "
                         f"over the tensor ranks; choose a degree that divides {gpt.n_heads}")
    if degree == 1:
        return
    if method == "ulysses":  # over the heads a tensor rank holds
        try:
            check_heads(gpt.n_heads // tensor, gpt.n_heads // tensor, degree)
        except ValueError as error:
            if tensor == 1:
                raise
            raise ValueError(f"--tp {tensor} --sp {degree}: each tensor rank holds {gpt.n_heads // tensor} of the "
                             f"{gpt.n_heads} heads of --model {model}, and Ulysses splits those: {error}") from None
    SequenceLayout(0, degree, head_tail=method == "ring").check_length(gpt.seq_len)


def default_out() -> str:
    return os.path.join("runs", "train-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def worker_args(args: argparse.Namespace, out: Path) -> list[str]:
    """The same command for each rank, with the output folder fixed once (one timestamp for all)."""
    argv = ["train", "--out", str(out)]
    flags = {"--config": args.config, "--stage": args.stage, "--steps": args.steps, "--model": args.model,
             "--micro-batch": args.micro_batch, "--lr": args.lr, "--seed": args.seed,
             "--save-interval": args.save_interval, "--keep-last": getattr(args, "keep_last", None), "--moe": args.moe,
             "--tp": args.tp, "--domino": args.domino, "--sp": getattr(args, "sp", None),
             "--sp-method": getattr(args, "sp_method", None), "--seq-len": getattr(args, "seq_len", None),
             "--pp": getattr(args, "pp", None), "--schedule": getattr(args, "schedule", None),
             "--trace": getattr(args, "trace", None), "--nnodes-sim": getattr(args, "nnodes_sim", None)}
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--bf16"] if args.bf16 else []) + (["--fp16"] if args.fp16 else []) + (
        ["--resume"] if args.resume else [])


def launcher_args(nproc: int) -> argparse.Namespace:
    """`zerodist run`'s launch arguments for one node."""
    return argparse.Namespace(nproc=nproc, nnodes="1", node_rank=None, master_addr=None, master_port=None,
                              rdzv_endpoint=None, rdzv_id="zerodist", max_restarts=0)


def _show(line: str) -> None:
    print(line, flush=True)


def train_in_place(plan: Any) -> int:
    """Train `plan` (a `zerodist.train.TrainPlan`) on this rank and print what rank 0 reports:
    the header and progress as the run goes, then the summary (the train layer returns it, the
    CLI shows it). Returns the exit code."""
    from zerodist.train import train

    outcome = train(plan, progress=_show)
    for line in outcome.lines:
        _show(line)
    for line in outcome.errors:
        print(line, file=sys.stderr, flush=True)
    return outcome.code


def run(args: argparse.Namespace) -> int:
    from zerodist.config import ConfigError

    in_place = "RANK" in os.environ
    nproc = int(os.environ.get("WORLD_SIZE", "1")) if in_place else (args.nproc or default_nproc())
    if nproc < 1:
        print(f"zerodist train: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    try:
        plan = build_plan(args, nproc)
    except (ConfigError, ValueError) as err:  # SequenceParallelError is a ValueError
        if os.environ.get("RANK", "0") == "0":
            print(f"zerodist train: {err}", file=sys.stderr)
        return 2
    if in_place or nproc == 1:
        from zerodist.checkpoint import CheckpointCorruptError

        try:
            return train_in_place(plan)
        except CheckpointCorruptError as err:
            # Raised alike on every rank by the resume (a damaged newest checkpoint): one message.
            if os.environ.get("RANK", "0") == "0":
                print(f"zerodist train: {err}", file=sys.stderr, flush=True)
            return 1
        except ConfigError as err:
            # What only the ranks can check (the schedule, the optimizer groups, ...): every rank
            # raises the same error at the same point, so rank 0 alone says it, without a
            # traceback, as the launcher does for what it checks before spawning.
            if os.environ.get("RANK", "0") == "0":
                print(f"zerodist train: {err}", file=sys.stderr, flush=True)
            return 2
    from zerodist.cli.run import launch, torchrun_argv

    return launch(torchrun_argv(launcher_args(nproc), "zerodist", worker_args(args, plan.out), module=True))
