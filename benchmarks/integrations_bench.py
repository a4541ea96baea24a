"""Hugging Face's Trainer driving zerodist (ZerodistTrainer) against zerodist's own loop and against
the same Trainer driving DeepSpeed.

    PYTHONPATH=. python benchmarks/integrations_bench.py [--stage 3] [--rounds 4] [--steps 25]
    PYTHONPATH=. DS_ACCELERATOR=cpu /work/venv-ds/bin/python benchmarks/integrations_bench.py   # with DeepSpeed

Three arms, each a fresh 2-rank run (`zerodist run --nproc 2`, gloo, one thread per rank, fp32):
- `loop`: zerodist's own loop (`initialize`, `engine(...)`, `backward`, `step`);
- `zerodist`: `ZerodistTrainer(config=<template>)`;
- `deepspeed`: the plain `transformers.Trainer` with `TrainingArguments(deepspeed=<template>)`, on
  DeepSpeed's CPU accelerator with gloo (skipped, with a line saying so, where DeepSpeed is not
  installed in this interpreter).
All three train the same Llama (hidden 256, 4 layers, vocab 256, 3.3M parameters) from the same seed on
the same batches (the Trainer's sequential sampler, which hands rank r the batches the loop indexes),
with LLaMA-Factory's ds_z{stage} template, "auto" filled from the same TrainingArguments (micro-batch
4 x 128 tokens, accumulation 2, clipping 1.0). The template names no optimizer, so every arm steps the
Trainer's own: torch's fused AdamW, lr 1e-3, weight decay 0 in the Trainer's two parameter groups, its
linear schedule. The loop does what the Trainer does to the model and optimizer before training
(`config.use_cache = False`: no KV cache built in training forwards) so that the arms differ only in
who drives the step. The arms run interleaved `--rounds` times in ABBA order (A B C, C B A, ...) so a
busy machine slows all alike; each run line carries the 1-minute load average at its start.

Time per optimizer step: the median over the steps after the first 5 (the Trainers' by a callback at
on_step_end, the loop's at the end of each accumulation window), then the median over rounds; wall
time, and rank 0's CPU time (`time.process_time`, all its threads). On a machine shared with other
work, where each rank gets a fraction of a core, wall time measures the scheduler as much as the arm
(the same arm's median moved up to 2.6x between rounds at load average 8-18); CPU time measures the
work each arm does, and moved by +-4%. `--report-only` prints the last run's summary again. Loss
per step: rank 0's loss of its accumulation window (the same data on rank 0 in every arm), compared
between arms. Needs transformers and accelerate; the DeepSpeed arm needs deepspeed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tests" / "config" / "templates"
MICRO, GAS, SEQ, WARMUP = 4, 2, 128, 5
ARMS = ("loop", "zerodist", "deepspeed")


def build(seed: int = 0):  # noqa: ANN201
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=SEQ,
                                      bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def data(samples: int):  # noqa: ANN201
    import torch

    ids = torch.randint(0, 256, (samples, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def template(stage: int) -> dict[str, Any]:
    return json.loads((TEMPLATE / f"llamafactory_ds_z{stage}_config.json").read_text())


def arguments(out: str, steps: int, deepspeed: dict[str, Any] | None = None):  # noqa: ANN201
    import transformers

    # Sequential sampling: accelerate deals batch i to rank i % world, which is the loop's indexing.
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS, max_steps=steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10**6, use_cpu=True, report_to=[], save_strategy="no",
        seed=0, disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential", deepspeed=deepspeed)


def recording(trainer_class: type) -> type:
    """``trainer_class`` that keeps each micro-step's loss (scaled for accumulation, as the Trainer
    returns it) and the time at the end of each optimizer step."""
    import transformers

    class Recording(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.micro_losses: list[float] = []
            self.step_ends: list[tuple[float, float]] = []
            ends = self.step_ends

            class StepEnds(transformers.TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
                    ends.append((time.perf_counter(), time.process_time()))

            super().__init__(*args, callbacks=[StepEnds()], **kwargs)

        def training_step(self, *args: Any, **kwargs: Any):  # noqa: ANN201
            loss = super().training_step(*args, **kwargs)
            self.micro_losses.append(float(loss))
            return loss

    return Recording


def run_zerodist(stage: int, steps: int, out: str) -> dict[str, Any]:
    from zerodist.integrations.transformers import ZerodistTrainer

    trainer = recording(ZerodistTrainer)(model=build(), args=arguments(out, steps),
                                         train_dataset=data(steps * MICRO * GAS * 2), config=template(stage))
    trainer.train()
    return result(trainer.step_ends, trainer.micro_losses)


def run_deepspeed(stage: int, steps: int, out: str) -> dict[str, Any]:
    import warnings

    import deepspeed
    import torch
    import transformers

    # DeepSpeed 0.19.8 calls torch.distributed's all_gather_into_tensor / reduce_scatter_tensor, which
    # torch 2.13 deprecates with a FutureWarning printed at every call (dozens per step): not kept.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.")
    # On its CPU accelerator DeepSpeed would pick oneCCL ("ccl"); accelerate, finding the process group
    # already made, keeps it, so every arm reduces over gloo.
    deepspeed.init_distributed(dist_backend="gloo")
    args = arguments(out, steps, deepspeed=template(stage))
    trainer = recording(transformers.Trainer)(model=build(), args=args, train_dataset=data(steps * MICRO * GAS * 2))
    trainer.train()
    return result(trainer.step_ends, trainer.micro_losses,
                  {"backend": torch.distributed.get_backend(), "engine": type(trainer.model_wrapped).__name__,
                   "optimizer": innermost_optimizer(trainer.optimizer)})


def innermost_optimizer(optimizer: Any) -> str:
    """The torch optimizer under accelerate's and DeepSpeed's wrappers, and whether it is fused."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})"


def run_loop(stage: int, steps: int, out: str) -> dict[str, Any]:
    import torch
    import transformers

    import zerodist
    import zerodist.comm as comm
    from zerodist.integrations.transformers import load_trainer_config

    model = build()
    args = arguments(out, steps)
    model.config.use_cache = args.use_cache  # what Trainer.__init__ does: no KV cache while training
    config = load_trainer_config(template(stage), args, model, steps)
    engine, *_ = zerodist.initialize(model=model, optimizer=trainer_optimizer(model, args),
                                     lr_scheduler=lambda optimizer: transformers.get_linear_schedule_with_warmup(
                                         optimizer, args.get_warmup_steps(steps), steps),
                                     config=config)
    samples, rank, world = data(steps * MICRO * GAS * 2), comm.get_rank(), comm.get_world_size()
    micro_losses: list[float] = []
    step_ends: list[tuple[float, float]] = []  # at the end of each step, as the Trainers' on_step_end
    for step in range(steps):
        for micro in range(GAS):
            start = ((step * GAS + micro) * world + rank) * MICRO
            ids = torch.stack([s["input_ids"] for s in samples[start:start + MICRO]])
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            micro_losses.append(float(loss.detach()) / GAS)
        step_ends.append((time.perf_counter(), time.process_time()))
    return result(step_ends, micro_losses)


def trainer_optimizer(model: Any, args: Any) -> Any:
    """The optimizer ``Trainer.create_optimizer`` builds: its class and arguments, weight decay only on
    the parameters it decays."""
    import transformers

    optimizer_cls, optimizer_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # uses no state of self
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    return optimizer_cls(groups, **optimizer_kwargs)


def result(step_ends: list[tuple[float, float]], micro_losses: list[float], extra: dict | None = None) -> dict:
    return {"seconds": [b[0] - a[0] for a, b in zip(step_ends, step_ends[1:])],
            "cpu_seconds": [b[1] - a[1] for a, b in zip(step_ends, step_ends[1:])],
            "losses": [sum(micro_losses[i:i + GAS]) for i in range(0, len(micro_losses), GAS)], **(extra or {})}


def child(kind: str, stage: int, steps: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    run = {"loop": run_loop, "zerodist": run_zerodist, "deepspeed": run_deepspeed}[kind]
    measured = run(stage, steps, out)
    if int(os.environ.get("RANK", "0")) == 0:
        measured["threads"] = torch.get_num_threads()
        Path(out, "result.json").write_text(json.dumps(measured))


def launch(kind: str, stage: int, steps: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", __file__, "--child", kind,
               "--stage", str(stage), "--steps", str(steps), "--out", str(out)]
    # OMP_NUM_THREADS=1: one thread per rank in every arm (zerodist run would set it too; accelerate
    # sets torch's thread count from the physical cores only when it is unset).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{kind} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads((out / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="/tmp/zerodist-integrations-bench")
    parser.add_argument("--report-only", action="store_true", help="print the summary of the last run in --out")
    parser.add_argument("--child", choices=ARMS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.stage, args.steps, args.out)
        return
    summary = Path(args.out) / f"z{args.stage}-summary.json"
    if args.report_only:
        report(args.stage, **json.loads(summary.read_text()))
        return
    arms = list(ARMS)
    if importlib.util.find_spec("deepspeed") is None:
        arms.remove("deepspeed")
        print(f"deepspeed arm skipped: DeepSpeed is not installed for {sys.executable}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    loads = []
    for round_ in range(args.rounds):
        # ABBA order: a machine whose load drifts during the run slows no arm more than another.
        for kind in arms if round_ % 2 == 0 else arms[::-1]:
            loads.append(os.getloadavg()[0])
            run = measure(launch(kind, args.stage, args.steps, Path(args.out) / f"z{args.stage}-{kind}-{round_}"))
            runs[kind].append(run)
            print(f"round {round_} {kind:9s} {run['ms']:7.1f} ms/step  (rank 0 CPU {run['cpu_ms']:6.1f} ms/step)  "
                  f"final loss {run['losses'][-1]:.6f}  load {loads[-1]:.1f}", flush=True)
    summary.write_text(json.dumps({"runs": runs, "loads": loads}))
    report(args.stage, runs, loads)


def measure(run: dict[str, Any]) -> dict[str, Any]:
    """A run's median wall and rank-0 CPU milliseconds per step, after the first WARMUP steps."""
    return {**run, "ms": statistics.median(run["seconds"][WARMUP:]) * 1000,
            "cpu_ms": statistics.median(run["cpu_seconds"][WARMUP:]) * 1000}


def report(stage: int, runs: dict[str, list[dict[str, Any]]], loads: list[float]) -> None:
    print(f"ZeRO {stage}, medians of {len(runs['loop'])} interleaved rounds, "
          f"load average {min(loads):.1f}-{max(loads):.1f} (1 min, at each run's start):")
    for arm in runs:
        print(f"  {arm:9s} {median(runs[arm], 'ms'):7.1f} ms/step  (rank 0 CPU {median(runs[arm], 'cpu_ms'):6.1f} "
              f"ms/step)  final loss {runs[arm][0]['losses'][-1]:.6f}")
    ratio("ZerodistTrainer / own loop", runs["zerodist"], runs["loop"])
    if "deepspeed" in runs:
        ratio("ZerodistTrainer / Trainer with DeepSpeed", runs["zerodist"], runs["deepspeed"])
        deepspeed = runs["deepspeed"][0]
        print(f"  DeepSpeed ran on {deepspeed['backend']}, {deepspeed['engine']} stepping {deepspeed['optimizer']}")
    reference = runs["zerodist"][0]["losses"]
    for arm in runs:
        if arm != "zerodist":
            gap = max(abs(a - b) for a, b in zip(runs[arm][0]["losses"], reference))
            print(f"  largest per-step loss gap, {arm} vs zerodist (rank 0, {len(reference)} steps): {gap:.2e}")


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def ratio(name: str, runs: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> None:
    """Wall and CPU time ratios of the medians, and per round (a round's two runs were neighbours)."""
    parts = []
    for key, what in (("ms", "wall"), ("cpu_ms", "rank 0 CPU")):
        each = ", ".join(f"{run[key] / baseline[key]:.2f}" for run, baseline in zip(runs, baselines))
        parts.append(f"{what} {median(runs, key) / median(baselines, key):.3f} (per round {each})")
    print(f"  {name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
