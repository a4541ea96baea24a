"""Hugging Face's Trainer driving zerodist (ZerodistTrainer) against zerodist's own loop.

    PYTHONPATH=. python benchmarks/integrations_bench.py [--stage 3] [--rounds 3] [--steps 25]

The same Llama (hidden 256, 4 layers, vocab 256, 3.3M parameters), the same config (LLaMA-Factory's
ds_z{stage} template, "auto" filled from the same TrainingArguments: micro-batch 4 x 128 tokens,
accumulation 2, clipping 1.0, the Trainer's AdamW (fused) lr 1e-3 with its linear schedule), 2 gloo ranks with one thread each, fp32. Each run is a
fresh `zerodist run --nproc 2`; the two are interleaved `--rounds` times, in ABBA order, so that a
busy machine slows both alike. The time per optimizer step is the median of the steps after the first 5 (the
Trainer's by a callback at on_step_end, the loop's around engine.step()). Prints the ratio. Needs
transformers and accelerate. DeepSpeed driven by the same Trainer is compared only where DeepSpeed
is installed (not on the development machine; the issue's goal is <= 0.9x its step time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tests" / "config" / "templates"
MICRO, GAS, SEQ, WARMUP = 4, 2, 128, 5


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


def arguments(out: str, steps: int):  # noqa: ANN201
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS, max_steps=steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10**6, use_cpu=True, report_to=[], save_strategy="no",
        seed=0, disable_tqdm=True, dataloader_num_workers=0)


def run_trainer(stage: int, steps: int, out: str) -> list[float]:
    import transformers

    from zerodist.integrations.transformers import ZerodistTrainer

    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            times.append(time.perf_counter())

    config = json.loads((TEMPLATE / f"llamafactory_ds_z{stage}_config.json").read_text())
    trainer = ZerodistTrainer(model=build(), args=arguments(out, steps), train_dataset=data(steps * MICRO * GAS * 2),
                              config=config, callbacks=[StepTimes()])
    trainer.train()
    return [b - a for a, b in zip(times, times[1:])]


def run_loop(stage: int, steps: int, out: str) -> list[float]:
    import torch
    import transformers

    import zerodist
    import zerodist.comm as comm
    from zerodist.config import Config
    from zerodist.integrations.transformers import load_trainer_config

    model = build()
    args = arguments(out, steps)
    config = load_trainer_config(json.loads((TEMPLATE / f"llamafactory_ds_z{stage}_config.json").read_text()), args,
                                 model, steps)
    # The Trainer's own optimizer choice (transformers 5 defaults to torch's fused AdamW).
    optimizer_cls, optimizer_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)  # the Trainer's linear
    engine, *_ = zerodist.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=Config.load(config))
    samples, rank, world = data(steps * MICRO * GAS * 2), comm.get_rank(), comm.get_world_size()
    times = [time.perf_counter()]
    for step in range(steps):
        for micro in range(GAS):
            start = ((step * GAS + micro) * world + rank) * MICRO
            ids = torch.stack([s["input_ids"] for s in samples[start:start + MICRO]])
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def child(kind: str, stage: int, steps: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    step_times = (run_trainer if kind == "trainer" else run_loop)(stage, steps, out)
    import zerodist.comm as comm

    if comm.get_rank() == 0:
        Path(out, "times.json").write_text(json.dumps(step_times))


def launch(kind: str, stage: int, steps: int, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", __file__, "--child", kind, "--stage", str(stage),
               "--steps", str(steps), "--out", str(out)]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=900)
    step_times = json.loads((out / "times.json").read_text())
    return statistics.median(step_times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="/tmp/zerodist-integrations-bench")
    parser.add_argument("--child", choices=["trainer", "loop"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.stage, args.steps, args.out)
        return
    results: dict[str, list[float]] = {"loop": [], "trainer": []}
    for round_ in range(args.rounds):
        # ABBA order: a machine whose load drifts during the run slows neither side more.
        for kind in ("loop", "trainer") if round_ % 2 == 0 else ("trainer", "loop"):
            results[kind].append(launch(kind, args.stage, args.steps, Path(args.out) / f"{kind}-{round_}"))
            print(f"round {round_} {kind:8s} {results[kind][-1] * 1000:8.1f} ms/step", flush=True)
    loop, trainer = statistics.median(results["loop"]), statistics.median(results["trainer"])
    print(f"ZeRO {args.stage}: own loop {loop * 1000:.1f} ms/step, ZerodistTrainer {trainer * 1000:.1f} ms/step, "
          f"ratio {trainer / loop:.3f} (medians of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
