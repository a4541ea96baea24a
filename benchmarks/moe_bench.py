"""MoE benchmark: zerodist's MoE against DeepSpeed's on the same GPT with MoE blocks.

    PYTHONPATH=. python benchmarks/moe_bench.py [--steps 20] [--model tiny] [--experts 4]

Two ranks (gloo, CPU, one thread each), expert parallel over both (ep=2), the same seed, batches
and routing (top-1; capacity mode with room for every token, so the two never drop differently,
and dropless mode). Each row: the loss after the last step and its largest difference from
zerodist's at any step, the median step time and its ratio to DeepSpeed's, the all-to-all bytes
one rank sends per step (zerodist: its tracer; DeepSpeed: torch.distributed.all_to_all_single
counted) against 4 x E x C x M x 4 bytes per MoE layer in capacity mode, and zerodist's
model-state bytes against the ZeRO formula per domain. A ZeRO-3 row shows what DeepSpeed says.
Timings on a shared 2-core machine are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ranks import enter_rank, free_port, run_ranks

WORLD_SIZE = 2
MICRO_BATCH, AUX_COEF, LR = 8, 0.01, 1e-3


@dataclasses.dataclass(frozen=True)
class Run:
    framework: str  # zerodist or deepspeed
    stage: int
    dropless: bool

    @property
    def name(self) -> str:
        return f"{self.framework} stage {self.stage} {'dropless' if self.dropless else 'capacity'}"


RUNS = [Run("zerodist", 2, False), Run("deepspeed", 2, False), Run("zerodist", 2, True), Run("deepspeed", 2, True),
        Run("zerodist", 3, False), Run("deepspeed", 3, False)]


def build_model(run: Run, preset: str, experts: int) -> Any:
    import torch

    from zerodist.models.gpt import gpt_config
    from zerodist.models.moe_gpt import MoEConfig, MoEGPT

    if run.framework == "deepspeed":
        from deepspeed.moe.layer import MoE as moe_class
    else:
        from zerodist.moe.layer import MoE as moe_class
    # capacity_factor = E: C = S, so no token is ever dropped and both libraries keep the same ones.
    moe = MoEConfig(num_experts=experts, ep_size=WORLD_SIZE, k=1, capacity_factor=float(experts),
                    drop_tokens=not run.dropless, use_rts=False, aux_loss_coef=AUX_COEF)
    torch.manual_seed(0)
    return MoEGPT(gpt_config(preset), moe, moe_class=moe_class)


def batch(step: int, rank: int, seq_len: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 256, (MICRO_BATCH, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def zerodist_engine(model: Any, run: Run) -> tuple[Any, Any]:
    import zerodist

    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": run.stage}}
    engine, *_ = zerodist.initialize(model=model, config=config)
    return engine, engine


def deepspeed_engine(model: Any, run: Run) -> tuple[Any, Any]:
    import deepspeed
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()), "name": "all"}])
    optimizer = torch.optim.AdamW(groups, lr=LR)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": run.stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, None


class AllToAllCounter:
    """Bytes this rank passes to torch.distributed.all_to_all_single (DeepSpeed's path)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = 0
        self.original = dist.all_to_all_single

        def counted(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            self.bytes += input.numel() * input.element_size()
            return self.original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted


def train(run: Run, preset: str, experts: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import zerodist.comm as comm

    model = build_model(run, preset, experts)
    counter = AllToAllCounter() if run.framework == "deepspeed" else None
    try:
        engine, zerodist_engine_or_none = (deepspeed_engine if counter else zerodist_engine)(model, run)
    except Exception as err:  # DeepSpeed refuses native MoE at ZeRO-3
        return {"refused": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    rank, losses, times = dist.get_rank(), [], []
    with comm.trace(ops=["all_to_all"]) as trace:
        for step in range(steps):
            inputs, targets = batch(step, rank, model.config.seq_len)
            started = time.perf_counter()
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - started)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / WORLD_SIZE)
    sent = counter.bytes if counter else trace.total_bytes("all_to_all")
    result = {"losses": losses, "step_times": times, "all_to_all_bytes_per_step": sent / steps}
    if zerodist_engine_or_none is not None:
        result["state_bytes"] = zerodist_engine_or_none.model_state_bytes()["total"]
        result["formula_bytes"] = state_formula(zerodist_engine_or_none, run.stage)
    return result


def state_formula(engine: Any, stage: int) -> int:
    """fp32 Adam: (4 + 12/N) Ψ at stage 2, 16Ψ/N at stage 3, per domain (N its group size)."""
    total = 0
    for group in engine.groups:
        psi, n = group.layout.total_numel, group.domain_group.size
        total += 16 * psi // n if group.policy.shard_parameters else 4 * psi + 12 * psi // n
    return total


def worker(rank: int, port: int, run: Run, preset: str, experts: int, steps: int, folder: str) -> None:
    enter_rank(rank, WORLD_SIZE, port, os.path.join(folder, f"rank{rank}.log"))
    try:
        result = train(run, preset, experts, steps)
    except BaseException:
        traceback.print_exc()
        raise
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))


def spawn(run: Run, preset: str, experts: int, steps: int, timeout_s: float = 600) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as folder:
        error = run_ranks(worker, (free_port(), run, preset, experts, steps, folder), nprocs=WORLD_SIZE,
                          timeout_s=timeout_s)
        if error is None:
            return json.loads(Path(folder, "rank0.json").read_text())
        tail = Path(folder, "rank0.log").read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"{error}: {' | '.join(tail)[:300]}"}


def formula_all_to_all(preset: str, experts: int) -> int:
    from zerodist.models.gpt import gpt_config
    from zerodist.moe.gating import capacity

    config = gpt_config(preset)
    tokens = MICRO_BATCH * config.seq_len
    slots = capacity(tokens, experts, 1, float(experts), 4)
    return 4 * experts * slots * config.d_model * 4 * config.n_layers


def report(results: dict[Run, dict[str, Any]], preset: str, experts: int) -> str:
    import statistics

    reference = {run.dropless: r["losses"] for run, r in results.items() if run.framework == "zerodist" and "losses" in r}
    ds_time = {run.dropless: statistics.median(r["step_times"]) for run, r in results.items()
               if run.framework == "deepspeed" and run.stage == 2 and "step_times" in r}
    lines = [f"GPT {preset!r} with {experts} experts per block, ep=2 on 2 ranks, top-1, micro-batch {MICRO_BATCH}",
             "| run | final loss | max loss diff vs zerodist | step ms | vs DeepSpeed stage 2 | all-to-all / step "
             "| model state (formula) |", "|---|---|---|---|---|---|---|"]
    formula = formula_all_to_all(preset, experts)
    for run, r in results.items():
        if "losses" not in r:
            lines.append(f"| {run.name} | {r.get('refused') or r.get('error')} | | | | | |")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], reference.get(run.dropless, r["losses"])))
        median = statistics.median(r["step_times"])
        ratio = f"{median / ds_time[run.dropless]:.2f}x" if run.dropless in ds_time else "-"
        traffic = f"{r['all_to_all_bytes_per_step'] / 2**10:.1f} KiB"
        if not run.dropless:
            traffic += f" (formula {formula / 2**10:.1f} KiB)"
        state = (f"{r['state_bytes'] / 2**10:.0f} KiB ({r['formula_bytes'] / 2**10:.0f} KiB)"
                 if "state_bytes" in r else "-")
        lines.append(f"| {run.name} | {r['losses'][-1]:.5f} | {diff:.2e} | {median * 1e3:.1f} | {ratio} | {traffic} | {state} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--experts", type=int, default=4)
    args = parser.parse_args(argv)
    results = {run: spawn(run, args.model, args.experts, args.steps) for run in RUNS}
    print(report(results, args.model, args.experts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
