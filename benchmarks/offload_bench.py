"""Offload benchmark: the optimizer on the host, and training steps with swapped optimizer state.

    python benchmarks/offload_bench.py                       # every part
    DS_ACCELERATOR=cpu /work/venv-ds/bin/python benchmarks/offload_bench.py   # with DeepSpeedCPUAdam too
    python benchmarks/offload_bench.py --part optimizer --threads 1 2

Part "optimizer" (one process): one AdamW step over 25M fp32 parameters held as the flat shards
zerodist steps (4 tensors of 6.25M), for-loop, foreach and fused `torch.optim.AdamW`, and
DeepSpeed's `DeepSpeedCPUAdam` when `deepspeed` imports (its C++ op is built on first use), at
each `--threads`; median of `--repeats` after one warm-up step.

Part "swap" (one process, one thread): the same 25M parameters stepped by AdamW in memory, then
by the swapped optimizer (sub-groups of `--sub-group-size`) with serial I/O, read-ahead only, and
read-ahead plus write-behind: step time and time blocked on I/O.

Part "train" (2 gloo ranks, one thread each): the "bench-25m" GPT (25.5M parameters) at ZeRO
stage 2, in memory, then with `offload_optimizer: nvme` and sub-groups of `--sub-group-size`
elements, pipelined (`pipeline_read` and `pipeline_write`) and serial; step time (forward,
backward, step) median over the timed steps, the slowest rank counts, and the time the swapped
step spent blocked on I/O. The swap files live under `--dir` (default: a temporary directory);
they are written through the page cache, so what is measured is this machine's buffered file
I/O, which is what a run here would see.

Part "stage3" (2 gloo ranks, one thread each): the same GPT at ZeRO stage 3, in memory, with
`offload_optimizer: nvme`, and with `offload_param: nvme` too (the parameter shards in the swap
files, read before each gather), pipelined I/O; as "train".

Part "checksum" (2 gloo ranks, one thread each): the cost of the swap files' checksums ([Note: swap
checksums] in zerodist/offload/swap_files.py): "train"'s pipelined nvme setting with checksums on
and off, `--rounds` runs of each interleaved (on, off, off, on, ...), so that load on the machine
falls on both alike; the median of each round's on/off step-time ratio.

Writes benchmarks/results/offload-<date>.json and .md (part "stage3" alone: offload-stage3-<date>,
"checksum" alone: offload-checksum-<date>).
A benchmark, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import free_port, run_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARAMS, PIECES = 25_000_000, 4


# ---------------------------------------------------------------- the optimizer on the host

def _optimizer_time(make: Any, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(PARAMS // PIECES, generator=generator) for _ in range(PIECES)]
    for tensor in tensors:
        tensor.grad = torch.randn(tensor.numel(), generator=generator)
    optimizer = make(tensors)
    optimizer.step()  # warm-up: the state is created here
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def optimizer_part(threads: list[int], repeats: int) -> list[dict[str, Any]]:
    options = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    kinds: dict[str, Any] = {
        "torch AdamW for-loop": lambda ts: torch.optim.AdamW(ts, foreach=False, **options),
        "torch AdamW foreach": lambda ts: torch.optim.AdamW(ts, foreach=True, **options),
        "torch AdamW fused": lambda ts: torch.optim.AdamW(ts, fused=True, **options),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        kinds["DeepSpeedCPUAdam"] = lambda ts: DeepSpeedCPUAdam(ts, adamw_mode=True, **options)
    except Exception as error:  # not installed, or its op does not build here
        print(f"DeepSpeedCPUAdam skipped: {type(error).__name__}: {str(error)[:200]}")
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        baseline = None
        for name, make in kinds.items():
            seconds = _optimizer_time(make, repeats)
            baseline = baseline or seconds
            rows.append({"optimizer": name, "threads": count, "step_s": seconds, "vs_for_loop": seconds / baseline})
            print(f"{name:>22}  {count} thread(s): {seconds * 1e3:8.1f} ms  ({seconds / baseline:.2f}x for-loop)")
    return rows


# ---------------------------------------------------------------- the swapped step alone, one process

def swap_part(directory: str, sub_group_size: int, repeats: int) -> list[dict[str, Any]]:
    """One AdamW step over 25M parameters in memory, then swapped (serial, read-ahead only, both)."""
    from zerodist.offload import StreamSettings, SwapDirectory, swapped

    torch.set_num_threads(1)
    options = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    settings = [("in memory", None), ("swapped, serial I/O", (False, False)),
                ("swapped, read-ahead", (True, False)), ("swapped, read-ahead + write-behind", (True, True))]
    rows: list[dict[str, Any]] = []
    baseline = None
    for index, (name, pipeline) in enumerate(settings):
        def make(tensors: list[torch.Tensor]) -> Any:
            inner = torch.optim.AdamW(tensors, **options)
            if pipeline is None:
                return inner
            return swapped(inner, SwapDirectory(directory, f"bench{index}", 0),
                           StreamSettings(sub_group_size, 4, pipeline[0], pipeline[1]))
        holder: list[Any] = []
        seconds = _optimizer_time(lambda ts: holder.append(make(ts)) or holder[-1], repeats)
        io_wait = getattr(holder[-1], "io_wait_s", 0.0) / (repeats + 1)
        if pipeline is not None:
            holder[-1].close()
        baseline = baseline or seconds
        rows.append({"setting": name, "step_s": seconds, "io_wait_s": io_wait, "vs_in_memory": seconds / baseline})
        print(f"{name:>36}: {seconds * 1e3:8.1f} ms ({seconds / baseline:.2f}x in memory), blocked on I/O "
              f"{io_wait * 1e3:6.1f} ms")
    return rows


# ---------------------------------------------------------------- training steps, 2 ranks

def _train_worker(rank: int, port: int, setting: dict[str, Any], steps: int, warmup: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if setting.get("code"):  # part "ratio": another tree's zerodist (the code before a change), same process setup
        sys.path.insert(0, setting["code"])
    import zerodist
    import zerodist.comm as comm
    from zerodist.models import GPT, gpt_config
    from zerodist.offload import SwapDirectory

    SwapDirectory.checksums = setting.get("checksums", True)
    torch.manual_seed(0)
    model = GPT(gpt_config("bench-25m"))
    zero: dict[str, Any] = {"stage": setting.get("stage", 2), "sub_group_size": setting["sub_group_size"]}
    if setting["offload"]:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": setting["dir"], "buffer_count": 4,
                                     "pipeline_read": setting["pipelined"], "pipeline_write": setting["pipelined"]}
    if setting.get("param"):
        zero["offload_param"] = {"device": "nvme"}
    options = {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01, **setting.get("options", {})}
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": options},
              "zero_optimization": zero}
    engine = zerodist.initialize(model=model, config=config)[0]
    tokens = torch.randint(0, 256, (4, model.config.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    times, step_times, io_before, crc_before = [], [], 0.0, 0.0
    for index in range(warmup + steps):
        comm.barrier()
        started = time.perf_counter()
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        stepped = time.perf_counter()
        engine.step()
        ended = time.perf_counter()
        if index >= warmup:
            times.append(ended - started)
            step_times.append(ended - stepped)
        if index == warmup - 1 and setting["offload"]:
            io_before = engine.zero_state.inner_optimizer.io_wait_s
        if index == warmup - 1 and setting["offload"]:
            crc_before = engine.zero_state.inner_optimizer.directory.counters.checksum_s
    io_wait = engine.zero_state.inner_optimizer.io_wait_s - io_before if setting["offload"] else 0.0
    crc = engine.zero_state.inner_optimizer.directory.counters.checksum_s - crc_before if setting["offload"] else 0.0
    everyone: list[Any] = [None, None]
    comm.all_gather_object(everyone, (times, step_times, io_wait / steps, crc / steps))
    if rank == 0:
        slowest = [max(a, b) for a, b in zip(everyone[0][0], everyone[1][0])]
        slowest_step = [max(a, b) for a, b in zip(everyone[0][1], everyone[1][1])]
        Path(out).write_text(json.dumps({"step_s": statistics.median(slowest),
                                         "optimizer_step_s": statistics.median(slowest_step),
                                         "io_wait_s": max(everyone[0][2], everyone[1][2]),
                                         "checksum_s": max(everyone[0][3], everyone[1][3])}))
    engine.destroy()


def train_part(directory: str, sub_group_size: int, steps: int, warmup: int, stage: int = 2) -> list[dict[str, Any]]:
    settings = [("in memory", False, False, False), ("nvme, pipelined I/O", True, True, False),
                ("nvme, serial I/O", True, False, False)]
    if stage == 3:
        settings = [("in memory", False, False, False), ("offload_optimizer nvme", True, True, False),
                    ("+ offload_param nvme", True, True, True)]
    rows: list[dict[str, Any]] = []
    baseline = None
    for name, offload, pipelined, param in settings:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            setting = {"offload": offload, "pipelined": pipelined, "dir": directory, "sub_group_size": sub_group_size,
                       "stage": stage, "param": param}
            error = run_ranks(_train_worker, (free_port(), setting, steps, warmup, out.name), nprocs=2, timeout_s=900)
            if error:
                print(f"{name}: {error}")
                continue
            result = json.loads(Path(out.name).read_text())
        baseline = baseline or result["step_s"]
        rows.append({"setting": name, **result, "vs_in_memory": result["step_s"] / baseline})
        print(f"{name:>20}: step {result['step_s'] * 1e3:7.1f} ms ({result['step_s'] / baseline:.2f}x in memory), "
              f"optimizer step {result['optimizer_step_s'] * 1e3:7.1f} ms, blocked on I/O "
              f"{result['io_wait_s'] * 1e3:6.1f} ms")
    return rows


def ratio_part(directory: str, sub_group_size: int, steps: int, warmup: int, rounds: int,
               before: str | None) -> dict[str, Any]:
    """NVMe step / in-memory step at stages 2 and 3, arms interleaved round by round (the order rotates),
    so that load on the machine falls on all alike; the median over rounds of each round's ratio.
    Arms: in memory (torch's default AdamW on the CPU: its for-loop), in memory with `foreach: true`,
    nvme pipelined, and with `before` (a directory holding another tree's `zerodist/`) nvme pipelined
    on that code."""
    arms: list[tuple[str, dict[str, Any]]] = [
        ("in memory", {"offload": False}), ("in memory, foreach", {"offload": False, "options": {"foreach": True}}),
        ("nvme, pipelined", {"offload": True})]
    if before:
        arms.append(("nvme, pipelined, before", {"offload": True, "code": before}))
    table: dict[str, Any] = {}
    for stage in (2, 3):
        times: dict[str, list[float]] = {name: [] for name, _ in arms}
        for round_ in range(rounds):
            order = arms[round_ % len(arms):] + arms[: round_ % len(arms)]
            for name, extra in order:
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    setting = {"pipelined": True, "dir": directory, "sub_group_size": sub_group_size, "stage": stage,
                               **extra}
                    error = run_ranks(_train_worker, (free_port(), setting, steps, warmup, out.name), nprocs=2,
                                      timeout_s=900)
                    if error:
                        raise SystemExit(f"stage {stage} {name}: {error}")
                    times[name].append(json.loads(Path(out.name).read_text())["step_s"])
                print(f"stage {stage} round {round_} {name:>26}: step {times[name][-1] * 1e3:7.1f} ms", flush=True)
        base = times["in memory"]
        table[f"stage{stage}"] = {name: {"step_s": values, "ratio_median": statistics.median(
            [v / b for v, b in zip(values, base)])} for name, values in times.items()}
        for name, row in table[f"stage{stage}"].items():
            print(f"stage {stage} {name:>26}: median ratio to in memory {row['ratio_median']:.3f}", flush=True)
    return {"rounds": rounds, "steps": steps, "warmup": warmup, **table}


def checksum_part(directory: str, sub_group_size: int, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Step time with the swap files' checksums on and off, interleaved."""
    runs: dict[bool, list[float]] = {True: [], False: []}
    optimizer_runs: dict[bool, list[float]] = {True: [], False: []}
    crc_runs: list[float] = []  # per run with checksums: the crc32 CPU time (the larger rank's) / the step's wall time
    crc_ms: list[float] = []
    for round_ in range(rounds):
        for checked in ((True, False) if round_ % 2 == 0 else (False, True)):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                setting = {"offload": True, "pipelined": True, "dir": directory, "sub_group_size": sub_group_size,
                           "checksums": checked}
                error = run_ranks(_train_worker, (free_port(), setting, steps, warmup, out.name), nprocs=2,
                                  timeout_s=900)
                if error:
                    raise SystemExit(f"checksums {'on' if checked else 'off'}: {error}")
                result = json.loads(Path(out.name).read_text())
            runs[checked].append(result["step_s"])
            optimizer_runs[checked].append(result["optimizer_step_s"])
            if checked:
                crc_runs.append(result["checksum_s"] / result["step_s"])
                crc_ms.append(result["checksum_s"] * 1e3)
            print(f"round {round_}: checksums {'on ' if checked else 'off'}: step {result['step_s'] * 1e3:7.1f} ms, "
                  f"optimizer step {result['optimizer_step_s'] * 1e3:7.1f} ms, crc32 {result['checksum_s'] * 1e3:.1f} ms CPU")
    ratios = [on / off for on, off in zip(runs[True], runs[False])]
    report = {"rounds": rounds, "step_s_on": runs[True], "step_s_off": runs[False],
              "optimizer_step_s_on": optimizer_runs[True], "optimizer_step_s_off": optimizer_runs[False],
              "ratio_median": statistics.median(ratios), "ratios": ratios, "crc_share": crc_runs,
              "crc_cpu_ms_per_step": crc_ms}
    print(f"checksums on / off, median of {rounds} rounds: {report['ratio_median']:.4f}; crc32 time / step: "
          f"{', '.join(f'{share:.2%}' for share in crc_runs)}")
    return report


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# Offload benchmark, {report['date']}", "", f"torch {report['torch']}, {report['cores']} cores.", ""]
    if report.get("optimizer"):
        lines += ["## One AdamW step over 25M fp32 parameters on the host", "",
                  "| optimizer | threads | step | vs for-loop |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['optimizer']} | {r['threads']} | {r['step_s'] * 1e3:.1f} ms | {r['vs_for_loop']:.2f}x |"
                  for r in report["optimizer"]]
        lines.append("")
    if report.get("swap"):
        lines += [f"## One AdamW step over 25M parameters, 1 thread, sub_group_size {report['sub_group_size']:,}", "",
                  "| setting | step | vs in memory | blocked on I/O |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['setting']} | {r['step_s'] * 1e3:.1f} ms | {r['vs_in_memory']:.2f}x | "
                  f"{r['io_wait_s'] * 1e3:.1f} ms |" for r in report["swap"]]
        lines.append("")
    for key, stage in (("train", 2), ("stage3", 3)):
        if not report.get(key):
            continue
        lines += [f"## bench-25m GPT, stage {stage}, 2 ranks, sub_group_size {report['sub_group_size']:,}", "",
                  "| setting | step | vs in memory | optimizer step | blocked on I/O |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['setting']} | {r['step_s'] * 1e3:.1f} ms | {r['vs_in_memory']:.2f}x | "
                  f"{r['optimizer_step_s'] * 1e3:.1f} ms | {r['io_wait_s'] * 1e3:.1f} ms |" for r in report[key]]
        lines.append("")
    if report.get("ratio"):
        r = report["ratio"]
        lines += [f"## NVMe step / in-memory step, bench-25m GPT, 2 ranks, {r['rounds']} interleaved rounds of "
                  f"{r['warmup']} + {r['steps']} steps", "", "| stage | arm | steps (ms, by round) | median ratio to in memory |",
                  "| --- | --- | --- | --- |"]
        for stage in (2, 3):
            for name, row in r[f"stage{stage}"].items():
                lines.append(f"| {stage} | {name} | {', '.join(f'{s * 1e3:.0f}' for s in row['step_s'])} | "
                             f"{row['ratio_median']:.3f} |")
        lines.append("")
    if report.get("checksum"):
        c = report["checksum"]
        lines += [f"## Swap checksums, bench-25m GPT, stage 2, nvme pipelined, 2 ranks, {c['rounds']} interleaved rounds",
                  "", "| round | step, checksums on | step, off | on / off |", "| --- | --- | --- | --- |"]
        lines += [f"| {i} | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | {ratio:.3f} |"
                  for i, (on, off, ratio) in enumerate(zip(c["step_s_on"], c["step_s_off"], c["ratios"]))]
        lines += ["", f"Median on / off: {c['ratio_median']:.3f}. CPU time computing crc32 per step (the larger rank's): "
                  f"{', '.join(f'{ms:.1f} ms' for ms in c['crc_cpu_ms_per_step'])}; as a share of the step's wall "
                  f"time: {', '.join(f'{share:.2%}' for share in c['crc_share'])}.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("optimizer", "swap", "train", "stage3", "checksum", "ratio", "all"),
                        default="all")
    parser.add_argument("--before", default=None, help="part ratio: a directory with the zerodist/ to compare against")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sub-group-size", type=float, default=1e6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="part checksum: runs of each variant")
    parser.add_argument("--dir", default=None, help="where the swap files go (default: a temporary directory)")
    args = parser.parse_args()
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                              "cores": os.cpu_count(), "sub_group_size": int(args.sub_group_size)}
    if args.part in ("optimizer", "all"):
        report["optimizer"] = optimizer_part(args.threads, args.repeats)
    if args.part in ("swap", "all"):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            report["swap"] = swap_part(directory, int(args.sub_group_size), args.repeats)
    if args.part in ("train", "all"):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            report["train"] = train_part(directory, int(args.sub_group_size), args.steps, args.warmup)
    if args.part in ("stage3", "all"):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            report["stage3"] = train_part(directory, int(args.sub_group_size), args.steps, args.warmup, stage=3)
    if args.part == "ratio":  # not in "all": interleaved rounds of every arm at two stages
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            report["ratio"] = ratio_part(directory, int(args.sub_group_size), args.steps, args.warmup, args.rounds,
                                         args.before)
    if args.part == "checksum":  # not in "all": its rounds take as long as the rest together
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            report["checksum"] = checksum_part(directory, int(args.sub_group_size), args.steps, args.warmup,
                                               args.rounds)
    RESULTS.mkdir(exist_ok=True)
    part = f"{args.part}-" if args.part in ("stage3", "checksum", "ratio") else ""
    stem = RESULTS / f"offload-{part}{report['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(_markdown(report))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
