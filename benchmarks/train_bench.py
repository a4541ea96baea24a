"""Training-step benchmark: zerodist ZeRO stages 0-3 against DDP, DeepSpeed and FSDP2.

    python benchmarks/train_bench.py                      # bench-3m and bench-25m, every framework installed
    python benchmarks/train_bench.py --phase interleaved --runs 3          # the step-time acceptance runs
    python benchmarks/train_bench.py --phase interleaved --runs 3 --under-load
    python benchmarks/train_bench.py --phase isolated --sizes bench-25m --configs zerodist-3 deepspeed-3
    python benchmarks/train_bench.py --sizes bench --configs ddp zerodist-2 --timed-steps 2   # a smoke run

Every configuration trains the same byte-level GPT (same seed, same weights, same global batch
of the same windows of the stdlib corpus, AdamW with the same hyper-parameters, gradient
clipping 1.0) on 2 gloo ranks with one thread each. Gradient buckets are 25 MiB everywhere:
DDP's `bucket_cap_mb=25`, and the same number of fp32 elements for zerodist's and DeepSpeed's
`reduce_bucket_size` / `allgather_bucket_size`.

Phase 1 ("isolated") runs each configuration alone in fresh processes and measures model-state
bytes per rank (zerodist: its own accounting; others: every distinct tensor storage reachable
from the parameters, their gradients and the optimizer, so buffers kept inside C++ such as DDP's
reducer buckets are not counted), peak RSS per rank while building and while training, where the
training peak goes (memory_breakdown.py), the collectives of one step, the final loss (mean of
the ranks) and a step time.

Phase 2 ("interleaved") runs all configurations in one pair of processes, a step of each in turn,
and gives the step times the table and the ratios use: rank 0's median wall time, and per rank
the CPU time (user + sys, all threads of the process), the time the training thread was off the
CPU (wall less its own run time and run-queue wait, from /proc: waiting, mostly for collectives,
measured the same way for every framework) and, for zerodist, the time blocked inside its own
collectives and `CommHandle.wait()` (`zerodist.comm.measure_blocked`). `--runs N` repeats phase 2
in N fresh process pairs; the table gives the median over runs and each run's ratio to DDP.
`--under-load` runs a second copy of phase 2 in the background for the whole benchmark, so the
ratios show how each configuration bears contention for the cores.

Collectives: zerodist's tracer gives the logical collectives; for every framework one extra
step runs under torch.profiler, whose `gloo:*` events show what gloo actually ran (on gloo a
reduce-scatter runs as an all-reduce of the whole input). Element counts from the profiler are
turned into bytes at 4 bytes each (every run here is fp32).

Writes benchmarks/results/<date>.json and .md. A benchmark, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from memory_breakdown import measure_step, reset_peak_rss, rss_status, warm_up_kernels
from ranks import enter_rank, free_port, run_ranks
from zerodist.debug.memory import heap_in_use
from train_bench_report import add_ratios, markdown, summarize_interleaved
from trainers import TRAINERS, WORLD_SIZE

SEED = 0
RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Size:
    name: str  # named by parameter count
    preset: str  # zerodist.models.gpt_config preset, with `overrides` applied
    micro_batch: int
    warmup_steps: int
    timed_steps: int
    timeout_s: float
    overrides: tuple[tuple[str, Any], ...] = ()

    def gpt_config(self) -> Any:
        from zerodist.models import gpt_config

        return gpt_config(self.preset, **dict(self.overrides))


@dataclasses.dataclass(frozen=True)
class Run:
    framework: str  # zerodist, ddp, deepspeed, fsdp2
    stage: int  # ZeRO stage (DDP: 0; FSDP2: 3, it shards parameters)
    reduce_scatter: bool = True  # zerodist only
    reuse: bool = True  # stage 3 (zerodist, DeepSpeed): False sets stage3_max_reuse_distance to 0
    overlap: bool = True  # zerodist only: overlap_comm (False: gather in step(), reduce after backward)

    @property
    def name(self) -> str:
        suffix = ("" if self.reduce_scatter else " (all-reduce)") + ("" if self.reuse else " (no reuse)") + \
            ("" if self.overlap else " (no overlap)")
        return f"{self.framework}{suffix}"

    @property
    def label(self) -> str:
        """The configuration's name on the command line (`--configs`)."""
        if self.framework in ("ddp", "fsdp2"):
            return self.framework
        return f"{self.framework}-{self.stage}" + ("" if self.reduce_scatter else "-allreduce") + \
            ("" if self.reuse else "-noreuse") + ("" if self.overlap else "-nooverlap")

    @property
    def stage3_options(self) -> dict[str, int]:
        """Stage-3 keys (zerodist and DeepSpeed alike); none at stages 0-2."""
        if self.stage != 3:
            return {}
        return {**STAGE3, **({} if self.reuse else {"stage3_max_reuse_distance": 0})}


# Stage 3 (zerodist and DeepSpeed alike): shard every parameter, as FSDP2 does per block; with
# DeepSpeed's default persistence threshold (1e5 elements) nothing of the 0.9M model would shard.
# Given to stage 3 only: at stages 0-2 it would split the buckets per unit too (one flattening plan
# for every stage, so that stage 3 is bitwise equal to them), which is not what is measured here.
STAGE3 = {"stage3_param_persistence_threshold": 0}

SIZES = {
    # 875,264 parameters: d_model 128, 4 blocks
    "bench": Size("bench", "bench", micro_batch=8, warmup_steps=5, timed_steps=40, timeout_s=300),
    # 3,323,392 parameters: d_model 256, 4 blocks (the issue-15 small model)
    "bench-3m": Size("bench-3m", "bench", micro_batch=8, warmup_steps=3, timed_steps=20, timeout_s=400,
                     overrides=(("d_model", 256), ("d_ff", None))),
    # 25,547,776 parameters: d_model 512, 8 blocks
    "bench-25m": Size("bench-25m", "bench-25m", micro_batch=4, warmup_steps=2, timed_steps=12, timeout_s=600),
}
DEFAULT_SIZES = ["bench-3m", "bench-25m"]
RUNS = [
    Run("ddp", 0),
    Run("zerodist", 0), Run("zerodist", 1), Run("zerodist", 2), Run("zerodist", 3), Run("zerodist", 3, reuse=False),
    Run("zerodist", 1, overlap=False), Run("zerodist", 2, overlap=False),
    Run("deepspeed", 0), Run("deepspeed", 1), Run("deepspeed", 2), Run("deepspeed", 3), Run("deepspeed", 3, reuse=False),
    Run("fsdp2", 3),
]


# ---------------------------------------------------------------------------------- on each rank
def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def global_batches(size: Size, num_steps: int) -> list[Any]:
    """The same (inputs, targets) global batches for every framework: seeded random windows."""
    import torch

    from zerodist.data import TokenDataset, split_corpus, stdlib_corpus

    seq_len = size.gpt_config().seq_len
    dataset = TokenDataset(split_corpus(stdlib_corpus(max_bytes=2_000_000, seed=SEED))[0], seq_len)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED))
    per_step = size.micro_batch * WORLD_SIZE
    batches = []
    for step in range(num_steps):
        items = [dataset[int(i)] for i in order[step * per_step: (step + 1) * per_step]]
        batches.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return batches


def rank_slice(batch: Any, rank: int, micro_batch: int) -> Any:
    inputs, targets = batch
    lo = rank * micro_batch
    return inputs[lo: lo + micro_batch], targets[lo: lo + micro_batch]




def import_framework(framework: str) -> None:
    """Import what the framework's trainer imports, so that the RSS baseline includes it."""
    if framework == "deepspeed":
        import deepspeed  # noqa: F401
    elif framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    else:
        import zerodist  # noqa: F401


def profiled_step(trainer: Any, batch: Any) -> tuple[float, dict[str, list[int]], float]:
    """One step under torch.profiler: its loss, the element count of each gloo op, and the summed
    duration of the gloo ops in ms. That duration is how long ops were in flight on gloo's threads,
    waiting for the peer included and overlapping compute or each other, so it is neither the cost
    of communicating nor the time the step waited for it; it is kept in the JSON only."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = trainer.step(*batch)
    ops: dict[str, list[int]] = {}
    gloo_us = 0.0
    for event in prof.events():
        if event.name.startswith("gloo:"):
            gloo_us += event.time_range.elapsed_us()
            if event.input_shapes and event.input_shapes[0]:
                numel = 1
                for dim in event.input_shapes[0]:
                    numel *= dim
                ops.setdefault(event.name[len("gloo:"):], []).append(numel)
    return loss, ops, gloo_us / 1e3


def train_isolated(run: Run, size: Size) -> dict[str, Any]:
    """Phase 1, one configuration alone in fresh processes: memory, collectives, loss, time."""
    import torch
    import torch.distributed as dist

    from zerodist.models import GPT

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # zerodist and DeepSpeed adopt it
    import_framework(run.framework)
    num_steps = size.warmup_steps + size.timed_steps + 2  # + the memory breakdown's and the profiled step
    batches = [rank_slice(b, rank, size.micro_batch) for b in global_batches(size, num_steps)]
    warm_up_kernels()
    baseline_rss, baseline_heap = rss_status()["VmRSS"], heap_in_use() or 0
    torch.manual_seed(SEED)
    model = GPT(size.gpt_config())
    num_parameters = sum(p.numel() for p in model.parameters())  # before stage 3 empties them
    trainer = TRAINERS[run.framework](model, run, size)
    init_peak = rss_status()["VmHWM"]
    peak_was_reset = reset_peak_rss()
    losses = [trainer.step(*batch) for batch in batches[:size.warmup_steps]]
    dist.barrier()
    times = []
    with trainer.trace() or contextlib.nullcontext() as trace:
        for batch in batches[size.warmup_steps:-2]:
            started = time.perf_counter()
            losses.append(trainer.step(*batch))
            times.append(time.perf_counter() - started)
    train_peak = rss_status()["VmHWM"] if peak_was_reset else peak_rss_bytes()
    dist.barrier()
    state_bytes = trainer.state_bytes()
    memory = {"baseline": baseline_rss, "init_peak": init_peak, "train_peak": train_peak,
              "peak_was_reset": peak_was_reset, "model_states": state_bytes, **measure_step(trainer, *batches[-2])}
    memory["heap_peak"] -= baseline_heap
    loss, gloo_ops, gloo_ms = profiled_step(trainer, batches[-1])
    losses.append(loss)  # (the breakdown step's loss is not returned; its step still trains)
    result = {"rank": rank, "step_times": times, "losses": losses, "state_bytes": state_bytes,
              "gloo_ops": gloo_ops, "gloo_in_flight_ms": gloo_ms, "memory": memory, "num_parameters": num_parameters}
    if trace is not None:
        result["tracer"] = {op: {"count": s.count / size.timed_steps, "bytes": s.num_bytes / size.timed_steps}
                            for op, s in trace.summary().items()}
    result["peak_rss"] = max(init_peak, train_peak)
    dist.barrier()
    return result


class ThreadClock:
    """This thread's time on the CPU and waiting in the run queue, from /proc (schedstat), so
    that wall time less both is the time it was off the CPU: blocked, mostly on collectives."""

    def __init__(self) -> None:
        self.path = f"/proc/self/task/{threading.get_native_id()}/schedstat"

    def busy_s(self) -> float:
        try:
            with open(self.path) as schedstat:
                on_cpu_ns, run_queue_ns = schedstat.read().split()[:2]
        except (OSError, ValueError):
            return float("nan")
        return (int(on_cpu_ns) + int(run_queue_ns)) / 1e9


def timed_step(trainer: Any, batch: Any, clock: ThreadClock) -> dict[str, float | None]:
    """One step's wall, process CPU, training-thread idle and (zerodist) blocked time, in seconds."""
    meter_context = trainer.blocked_meter()
    started, cpu_started, busy_started = time.perf_counter(), time.process_time(), clock.busy_s()
    with meter_context or contextlib.nullcontext() as meter:
        trainer.step(*batch)
    wall = time.perf_counter() - started
    return {"wall": wall, "cpu": time.process_time() - cpu_started, "idle": wall - (clock.busy_s() - busy_started),
            "blocked": meter.seconds if meter is not None else None}


def train_interleaved(runs: list[Run], size: Size) -> dict[str, Any]:
    """Phase 2, every configuration in the same two processes, one step of each in turn.

    On a machine shared with other work, a burst of load then slows every configuration's
    steps alike instead of whichever configuration ran during it, so the ratios hold even when
    the absolute times do not. Each timed step starts from a barrier, and the order rotates
    every step so no configuration always follows the same one."""
    import torch
    import torch.distributed as dist

    from zerodist.models import GPT

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    trainers = []
    for run in runs:
        torch.manual_seed(SEED)
        trainers.append(TRAINERS[run.framework](GPT(size.gpt_config()), run, size))
    num_steps = size.warmup_steps + size.timed_steps
    batches = [rank_slice(b, rank, size.micro_batch) for b in global_batches(size, num_steps)]
    samples: list[list[dict[str, float | None]]] = [[] for _ in runs]
    clock = ThreadClock()
    load_before = os.getloadavg()
    for step, batch in enumerate(batches):
        for k in range(len(runs)):
            index = (step + k) % len(runs)
            dist.barrier()
            sample = timed_step(trainers[index], batch, clock)
            if step >= size.warmup_steps:
                samples[index].append(sample)
    dist.barrier()
    keys = ("wall", "cpu", "idle", "blocked")
    return {"rank": rank, **{f"{key}_times": [[s[key] for s in per_run] for per_run in samples] for key in keys},
            "load_average": [max(a, b) for a, b in zip(load_before, os.getloadavg())]}


def worker(local_rank: int, port: int, phase: str, runs: list[Run], size: Size, folder: str) -> None:
    """One rank: fresh process, one thread, output to a log file, result as JSON."""
    enter_rank(local_rank, WORLD_SIZE, port, os.path.join(folder, f"rank{local_rank}.log"))
    try:
        result = train_isolated(runs[0], size) if phase == "isolated" else train_interleaved(runs, size)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    Path(folder, f"rank{local_rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------- the driver
def spawn(phase: str, runs: list[Run], size: Size, timeout_s: float) -> dict[str, Any]:
    """Both ranks in fresh processes; their results, or the error with rank 0's log tail."""
    with tempfile.TemporaryDirectory(prefix="train_bench_") as folder:
        error = run_ranks(worker, (free_port(), phase, runs, size, folder), nprocs=WORLD_SIZE, timeout_s=timeout_s)
        if error is None:
            return {"ranks": [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]}
        logs = [Path(folder, f"rank{r}.log").read_text(errors="replace") for r in range(WORLD_SIZE)]
        last = next((line for log in logs for line in reversed(log.strip().splitlines()) if "Error" in line), "")
        return {"error": f"{error}: {last.strip()[:200]}", "log_tail": logs[0][-2000:]}


def available(framework: str) -> str | None:
    """None when the framework can run here, else why not."""
    try:
        if framework == "deepspeed":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import_framework(framework)
    except ImportError as err:
        return f"not installed ({err})"
    return None


def summarize_isolated(run: Run, size: Size, outcome: dict[str, Any]) -> dict[str, Any]:
    """Phase 1's fields of a configuration's row."""
    if "ranks" not in outcome:
        return {"error": outcome["error"]}
    ranks = outcome["ranks"]
    finals = [r["losses"][-1] for r in ranks]
    return {"isolated_ms": 1e3 * statistics.median(ranks[0]["step_times"]),
            "state_bytes": [r["state_bytes"] for r in ranks], "peak_rss": [r["peak_rss"] for r in ranks],
            "memory": [r["memory"] for r in ranks], "final_loss": sum(finals) / len(finals),
            "gloo_ops": ranks[0]["gloo_ops"], "gloo_in_flight_ms": ranks[0]["gloo_in_flight_ms"], "tracer": ranks[0].get("tracer"),
            "num_parameters": ranks[0]["num_parameters"]}


def machine_line() -> str:
    import platform

    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores, {memory:.0f} GiB, CPU ({platform.processor() or platform.machine()}), gloo, "
            f"{WORLD_SIZE} ranks x 1 thread, torch {torch.__version__}, Python {platform.python_version()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    p.add_argument("--frameworks", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    p.add_argument("--configs", nargs="+", default=None, choices=[r.label for r in RUNS],
                   help="only these configurations (default: every one of --frameworks)")
    p.add_argument("--phase", choices=["both", "isolated", "interleaved"], default="both",
                   help="isolated: each configuration alone (memory, collectives); interleaved: the step times")
    p.add_argument("--runs", type=int, default=1, help="interleaved runs per size, each in fresh processes")
    p.add_argument("--timed-steps", type=int, default=None, help="override the timed steps of every size")
    p.add_argument("--warmup-steps", type=int, default=None, help="override the warm-up steps of every size")
    p.add_argument("--under-load", action="store_true",
                   help="run a second copy of the interleaved phase in the background throughout")
    p.add_argument("--load-forever", action="store_true", help=argparse.SUPPRESS)  # the background copy
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="names the result files")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def selected_runs(args: argparse.Namespace) -> list[Run]:
    return [r for r in RUNS if r.framework in args.frameworks and (args.configs is None or r.label in args.configs)]


def sizes_of(args: argparse.Namespace) -> list[Size]:
    overrides = {k: v for k, v in (("timed_steps", args.timed_steps), ("warmup_steps", args.warmup_steps)) if v is not None}
    return [dataclasses.replace(SIZES[name], **overrides) for name in args.sizes]


def run_isolated(runs: list[Run], size: Size, rows: dict[Run, dict[str, Any]]) -> None:
    for run in runs:
        why_not = available(run.framework)
        started = time.monotonic()
        outcome = {"error": why_not} if why_not else spawn("isolated", [run], size, size.timeout_s)
        rows[run].update(summarize_isolated(run, size, outcome))
        shown = f"{rows[run]['isolated_ms']:.1f} ms/step" if "isolated_ms" in rows[run] else rows[run]["error"]
        print(f"  alone: {size.name:<10} {run.label:<20}: {shown} ({time.monotonic() - started:.0f} s)", flush=True)


def run_interleaved(runs: list[Run], size: Size, rows: dict[Run, dict[str, Any]], index: int) -> None:
    """One interleaved run over the configurations that can run; appends to each row's `runs`."""
    ran = [run for run in runs if "error" not in rows[run] and available(run.framework) is None]
    for run in runs:
        if run not in ran:
            rows[run].setdefault("error", available(run.framework) or "phase 1 failed")
    if not ran:
        return
    started = time.monotonic()
    outcome = spawn("interleaved", ran, size, size.timeout_s * len(ran))
    for position, run in enumerate(ran):
        if "ranks" not in outcome:
            rows[run].setdefault("runs", []).append({"error": outcome["error"]})
            continue
        rows[run].setdefault("runs", []).append(
            {key: [r[f"{key}_times"][position] for r in outcome["ranks"]] for key in ("wall", "cpu", "idle", "blocked")}
            | {"load_average": outcome["ranks"][0]["load_average"]})
    print(f"  interleaved run {index + 1}: {size.name} ({time.monotonic() - started:.0f} s, "
          f"{len(ran)} configurations{'' if 'ranks' in outcome else ': ' + outcome['error']})", flush=True)


@contextlib.contextmanager
def background_load(argv: list[str]) -> Any:
    """A second copy of the interleaved phase, repeated until the block ends, in its own session so
    that it and its ranks end together."""
    command = [sys.executable, os.path.abspath(__file__), *argv, "--load-forever"]
    load = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    print(f"  under load: a background copy runs (pid {load.pid})", flush=True)
    try:
        yield
    finally:
        os.killpg(load.pid, signal.SIGTERM)
        try:
            load.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait()


def load_forever(args: argparse.Namespace) -> int:
    """The background copy of `--under-load`: interleaved runs, results discarded, until killed."""
    while True:
        for size in sizes_of(args):
            spawn("interleaved", [r for r in selected_runs(args) if available(r.framework) is None], size,
                  size.timeout_s * len(RUNS))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.load_forever:
        return load_forever(args)
    load_note = "; under load: a second copy of the interleaved phase ran throughout" if args.under_load else ""
    header = f"Train-step benchmark, {args.date}: {machine_line()}{load_note}"
    print(header, flush=True)
    runs, started = selected_runs(args), time.monotonic()
    all_rows: list[dict[str, Any]] = []
    load = background_load([a for a in argv if a != "--under-load"]) if args.under_load else contextlib.nullcontext()
    with load:
        rows_by_size = {size.name: {run: {"size": size.name, "framework": run.name, "label": run.label,
                                          "stage": run.stage, "reuse": run.reuse} for run in runs}
                        for size in sizes_of(args)}
        for size in sizes_of(args):
            if args.phase in ("both", "isolated"):
                run_isolated(runs, size, rows_by_size[size.name])
        if args.phase in ("both", "interleaved"):
            for index in range(args.runs):
                for size in sizes_of(args):
                    run_interleaved(runs, size, rows_by_size[size.name], index)
    for rows in rows_by_size.values():
        all_rows += [summarize_interleaved(row) for row in rows.values()]
    add_ratios(all_rows)
    print(f"  (all phases {time.monotonic() - started:.0f} s)", flush=True)
    text = markdown(all_rows, header)
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.date + ("-under-load" if args.under_load else "")
    (args.out / f"{name}.json").write_text(json.dumps({"header": header, "rows": all_rows}, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(text + "\n")
    print(f"wrote {args.out / (name + '.json')} and {args.out / (name + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
