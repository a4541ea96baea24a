"""Training-step benchmark: zerodist ZeRO stages 0/1/2 against DDP, DeepSpeed and FSDP2.

    python benchmarks/train_bench.py                      # both sizes, every framework installed
    python benchmarks/train_bench.py --sizes bench --frameworks zerodist ddp

Every configuration trains the same byte-level GPT (same seed, same weights, same global batch
of the same windows of the stdlib corpus, AdamW with the same hyper-parameters, gradient
clipping 1.0) on 2 gloo ranks with one thread each. Gradient buckets are 25 MiB everywhere:
DDP's `bucket_cap_mb=25`, and the same number of fp32 elements for zerodist's and DeepSpeed's
`reduce_bucket_size` / `allgather_bucket_size`.

Phase 1 runs each configuration alone in fresh processes and measures model-state bytes per
rank (zerodist: its own accounting; others: every distinct tensor storage reachable from the
parameters, their gradients and the optimizer, so buffers kept inside C++ such as DDP's reducer
buckets are not counted), peak RSS per rank, the collectives of one step, the final loss (mean
of the ranks) and a step time.

Phase 2 runs all configurations in one pair of processes, a step of each in turn, and gives the
step times the table and the ratios use: rank 0's median wall time, and the CPU time (user +
sys) of each rank. On a machine shared with other work, a burst of load then slows every
configuration alike, and CPU time hardly moves at all. Ratios are to DDP and to DeepSpeed at the
same stage, from the same phase-2 run.

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
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BUCKET_MB = 25
BUCKET_ELEMENTS = BUCKET_MB * 1024 * 1024 // 4  # fp32 elements in DDP's bucket_cap_mb
WORLD_SIZE = 2
SEED = 0
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
CLIP = 1.0
RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Size:
    model: str
    micro_batch: int
    warmup_steps: int
    timed_steps: int
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class Run:
    framework: str  # zerodist, ddp, deepspeed, fsdp2
    stage: int  # ZeRO stage (DDP: 0; FSDP2: 3, it shards parameters)
    reduce_scatter: bool = True  # zerodist only
    reuse: bool = True  # stage 3 (zerodist, DeepSpeed): False sets stage3_max_reuse_distance to 0

    @property
    def name(self) -> str:
        suffix = ("" if self.reduce_scatter else " (all-reduce)") + ("" if self.reuse else " (no reuse)")
        return f"{self.framework}{suffix}"

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
    "bench": Size("bench", micro_batch=8, warmup_steps=5, timed_steps=40, timeout_s=300),
    "bench-25m": Size("bench-25m", micro_batch=4, warmup_steps=2, timed_steps=12, timeout_s=600),
}
RUNS = [
    Run("ddp", 0),
    Run("zerodist", 0), Run("zerodist", 1), Run("zerodist", 2), Run("zerodist", 3), Run("zerodist", 3, reuse=False),
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
    from zerodist.models import gpt_config

    seq_len = gpt_config(size.model).seq_len
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


def storage_bytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages in `roots` (tensors, their .grad, nested containers)."""
    import torch

    seen: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # DTensor: this rank's shard
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            if item.grad is not None:
                stack.append(item.grad)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class EngineStep:
    """zerodist's and DeepSpeed's engines share one training-step API."""

    engine: Any

    def step(self, inputs: Any, targets: Any) -> float:
        loss = self.engine(inputs, targets)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss)


class ZerodistTrainer(EngineStep):
    def __init__(self, model: Any, run: Run, size: Size):
        import zerodist

        config = {
            "train_micro_batch_size_per_gpu": size.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "gradient_clipping": CLIP, "steps_per_print": 10**6,
            "zero_optimization": {"stage": run.stage, "reduce_scatter": run.reduce_scatter,
                                  "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS,
                                  **run.stage3_options},
        }
        self.engine, _, _, _ = zerodist.initialize(model=model, config=config)
        self.trace: Any = None

    def state_bytes(self) -> int:
        return self.engine.model_state_bytes()["total"]

    def timed(self) -> Any:
        import zerodist.comm as comm

        return comm.trace()


class DDPTrainer:
    def __init__(self, model: Any, run: Run, size: Size):
        import torch

        self.model = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(self, inputs: Any, targets: Any) -> float:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss = self.ddp(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return float(loss)

    def state_bytes(self) -> int:
        return storage_bytes(list(self.model.parameters()), self.optimizer.state)

    def timed(self) -> Any:
        return None


class FSDP2Trainer(DDPTrainer):
    def __init__(self, model: Any, run: Run, size: Size):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = self.ddp = model
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)


class DeepSpeedTrainer(EngineStep):
    def __init__(self, model: Any, run: Run, size: Size):
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": size.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": run.stage, "reduce_bucket_size": BUCKET_ELEMENTS,
                                  "allgather_bucket_size": BUCKET_ELEMENTS, **run.stage3_options},
        }
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        self.model = model
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def state_bytes(self) -> int:
        """Parameters, gradients, the optimizer's state and every tensor the ZeRO wrapper holds
        directly (flat buffers, fp32 partitions, reduce buckets)."""
        wrapper = self.optimizer
        inner = getattr(wrapper, "optimizer", wrapper)
        held = [v for v in vars(wrapper).values() if _is_tensor_container(v)] if inner is not wrapper else []
        return storage_bytes(list(self.model.parameters()), inner.state, held)

    def timed(self) -> Any:
        return None


def _is_tensor_container(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_is_tensor_container(v) for v in value[:4])


TRAINERS = {"zerodist": ZerodistTrainer, "ddp": DDPTrainer, "deepspeed": DeepSpeedTrainer, "fsdp2": FSDP2Trainer}


def profiled_step(trainer: Any, batch: Any) -> tuple[float, dict[str, list[int]]]:
    """One step under torch.profiler; returns its loss and the element count of each gloo op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = trainer.step(*batch)
    ops: dict[str, list[int]] = {}
    for event in prof.events():
        if event.name.startswith("gloo:") and event.input_shapes and event.input_shapes[0]:
            numel = 1
            for dim in event.input_shapes[0]:
                numel *= dim
            ops.setdefault(event.name[len("gloo:"):], []).append(numel)
    return loss, ops


def train_isolated(run: Run, size: Size) -> dict[str, Any]:
    """Phase 1, one configuration alone in fresh processes: memory, collectives, loss, time."""
    import torch
    import torch.distributed as dist

    from zerodist.models import GPT, gpt_config

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # zerodist and DeepSpeed adopt it
    torch.manual_seed(SEED)
    model = GPT(gpt_config(size.model))
    num_steps = size.warmup_steps + size.timed_steps + 1
    batches = [rank_slice(b, rank, size.micro_batch) for b in global_batches(size, num_steps)]
    trainer = TRAINERS[run.framework](model, run, size)
    losses = [trainer.step(*batch) for batch in batches[:size.warmup_steps]]
    dist.barrier()
    times = []
    with trainer.timed() or contextlib.nullcontext() as trace:
        for batch in batches[size.warmup_steps:-1]:
            started = time.perf_counter()
            losses.append(trainer.step(*batch))
            times.append(time.perf_counter() - started)
    loss, gloo_ops = profiled_step(trainer, batches[-1])
    losses.append(loss)
    result = {"rank": rank, "step_times": times, "losses": losses, "state_bytes": trainer.state_bytes(),
              "gloo_ops": gloo_ops, "num_parameters": sum(p.numel() for p in model.parameters())}
    if trace is not None:
        result["tracer"] = {op: {"count": s.count / size.timed_steps, "bytes": s.num_bytes / size.timed_steps}
                            for op, s in trace.summary().items()}
    result["peak_rss"] = peak_rss_bytes()
    dist.barrier()
    return result


def train_interleaved(runs: list[Run], size: Size) -> dict[str, Any]:
    """Phase 2, every configuration in the same two processes, one step of each in turn.

    On a machine shared with other work, a burst of load then slows every configuration's
    steps alike instead of whichever configuration ran during it, so the ratios hold even when
    the absolute times do not. Each timed step starts from a barrier, and the order rotates
    every step so no configuration always follows the same one."""
    import torch
    import torch.distributed as dist

    from zerodist.models import GPT, gpt_config

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    trainers = []
    for run in runs:
        torch.manual_seed(SEED)
        trainers.append(TRAINERS[run.framework](GPT(gpt_config(size.model)), run, size))
    num_steps = size.warmup_steps + size.timed_steps
    batches = [rank_slice(b, rank, size.micro_batch) for b in global_batches(size, num_steps)]
    times: list[list[float]] = [[] for _ in runs]
    cpu_times: list[list[float]] = [[] for _ in runs]
    for step, batch in enumerate(batches):
        for k in range(len(runs)):
            index = (step + k) % len(runs)
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            trainers[index].step(*batch)
            if step >= size.warmup_steps:
                times[index].append(time.perf_counter() - started)
                cpu_times[index].append(time.process_time() - cpu_started)
    dist.barrier()
    return {"rank": rank, "step_times": times, "cpu_times": cpu_times, "load_average": os.getloadavg()}


def worker(local_rank: int, port: int, phase: str, runs: list[Run], size: Size, folder: str) -> None:
    """One rank: fresh process, one thread, output to a log file, result as JSON."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    log = os.open(os.path.join(folder, f"rank{local_rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch

    torch.set_num_threads(1)
    try:
        result = train_isolated(runs[0], size) if phase == "isolated" else train_interleaved(runs, size)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    Path(folder, f"rank{local_rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(phase: str, runs: list[Run], size: Size, timeout_s: float) -> dict[str, Any]:
    """Both ranks in fresh processes; their results, or the error with rank 0's log tail."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="train_bench_") as folder:
        context = mp.start_processes(worker, args=(free_port(), phase, runs, size, folder), nprocs=WORLD_SIZE,
                                     join=False)
        deadline = time.monotonic() + timeout_s
        error = None
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f} s"
                    break
        except Exception:  # a rank failed: its log ends with the exception
            error = "failed"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
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
            import deepspeed  # noqa: F401
        elif framework == "fsdp2":
            from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as err:
        return f"not installed ({err})"
    return None


def summarize(run: Run, size: Size, outcome: dict[str, Any]) -> dict[str, Any]:
    """One table row from phase 1 (the configuration alone)."""
    row: dict[str, Any] = {"size": size.model, "framework": run.name, "stage": run.stage}
    if "ranks" not in outcome:
        return {**row, **outcome}
    ranks = outcome["ranks"]
    finals = [r["losses"][-1] for r in ranks]
    return {**row, "isolated_ms": 1e3 * statistics.median(ranks[0]["step_times"]),
            "state_bytes": [r["state_bytes"] for r in ranks], "peak_rss": [r["peak_rss"] for r in ranks],
            "final_loss": sum(finals) / len(finals), "gloo_ops": ranks[0]["gloo_ops"],
            "tracer": ranks[0].get("tracer"), "num_parameters": ranks[0]["num_parameters"]}


def add_interleaved(rows: list[dict[str, Any]], runs: list[Run], outcome: dict[str, Any]) -> None:
    """Phase 2's median step time (rank 0) into each configuration's row."""
    for run, row in zip(runs, rows):
        if "ranks" in outcome:
            times = outcome["ranks"][0]["step_times"][runs.index(run)]
            row["step_ms"] = 1e3 * statistics.median(times)
            row["cpu_ms"] = [1e3 * statistics.median(r["cpu_times"][runs.index(run)]) for r in outcome["ranks"]]
            row["step_ms_iqr"] = [1e3 * q for q in statistics.quantiles(times, n=4)[::2]] if len(times) > 1 else None
            row["load_average"] = outcome["ranks"][0]["load_average"]
        else:
            row["interleaved_error"] = outcome["error"]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each step time (wall, and CPU summed over ranks) over DDP's and over DeepSpeed's at the
    same stage, from the same interleaved run."""
    for row in rows:
        if "step_ms" not in row:
            continue
        peers = [r for r in rows if r["size"] == row["size"] and "step_ms" in r]
        ddp = next((r for r in peers if r["framework"] == "ddp"), None)
        ds_stage = 0 if row["framework"] == "ddp" else row["stage"]
        ds_name = "deepspeed (no reuse)" if row["framework"].endswith(" (no reuse)") else "deepspeed"
        ds = next((r for r in peers if r["framework"] == ds_name and r["stage"] == ds_stage), None)
        for name, base in (("ddp", ddp), ("deepspeed", ds)):
            row[f"vs_{name}"] = row["step_ms"] / base["step_ms"] if base else None
            row[f"cpu_vs_{name}"] = sum(row["cpu_ms"]) / sum(base["cpu_ms"]) if base else None


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def format_bytes(num_bytes: float) -> str:
    from zerodist.utils import format_bytes as zerodist_format

    return zerodist_format(num_bytes)


def comm_cell(row: dict[str, Any]) -> str:
    parts = []
    if row.get("tracer"):
        parts.append("tracer: " + ", ".join(f"{op} {s['count']:g}x {format_bytes(s['bytes'])}"
                                            for op, s in row["tracer"].items()))
    gloo = row.get("gloo_ops") or {}
    if gloo:
        parts.append("gloo: " + ", ".join(f"{op} {len(n)}x {format_bytes(4 * sum(n))}" for op, n in gloo.items()))
    return "; ".join(parts) or "-"


def spread_cell(row: dict[str, Any]) -> str:
    low, high = row.get("step_ms_iqr") or (None, None)
    return "-" if low is None else f"{low:.0f}-{high:.0f}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        params = next((r["num_parameters"] for r in rows if r["size"] == size and "num_parameters" in r), None)
        lines += [f"### {size}" + (f" ({params:,} parameters)" if params else ""), "",
                  "| framework | stage | step ms | quartiles | alone ms | CPU ms (r0+r1) | vs DDP (wall / CPU) "
                  "| vs DeepSpeed (wall / CPU) | model state / rank | peak RSS / rank | collectives per step (rank 0) "
                  "| final loss |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in (r for r in rows if r["size"] == size):
            if "isolated_ms" not in r:
                lines.append(f"| {r['framework']} | {r['stage']} | {r.get('error', 'skipped')} | | | | | | | | | |")
                continue
            step = f"{r['step_ms']:.1f}" if "step_ms" in r else r.get("interleaved_error", "-")
            cpu = " + ".join(f"{t:.0f}" for t in r["cpu_ms"]) if "cpu_ms" in r else "-"
            lines.append(f"| {r['framework']} | {r['stage']} | {step} | {spread_cell(r)} | {r['isolated_ms']:.1f} | "
                         f"{cpu} | {ratio(r.get('vs_ddp'))} / {ratio(r.get('cpu_vs_ddp'))} | "
                         f"{ratio(r.get('vs_deepspeed'))} / {ratio(r.get('cpu_vs_deepspeed'))} | "
                         f"{' / '.join(mib(b) for b in r['state_bytes'])} | "
                         f"{' / '.join(mib(b) for b in r['peak_rss'])} | {comm_cell(r)} | {r['final_loss']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def machine_line() -> str:
    import platform

    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores, {memory:.0f} GiB, CPU ({platform.processor() or platform.machine()}), gloo, "
            f"{WORLD_SIZE} ranks x 1 thread, torch {torch.__version__}, Python {platform.python_version()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--frameworks", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    p.add_argument("--timed-steps", type=int, default=None, help="override the timed steps of every size")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="names the result files")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def run_size(size: Size, frameworks: list[str]) -> list[dict[str, Any]]:
    """Phase 1 for each configuration, then phase 2 over those that ran."""
    runs = [r for r in RUNS if r.framework in frameworks]
    rows = []
    for run in runs:
        why_not = available(run.framework)
        started = time.monotonic()
        outcome = {"error": why_not} if why_not else spawn("isolated", [run], size, size.timeout_s)
        rows.append(summarize(run, size, outcome))
        shown = f"{rows[-1]['isolated_ms']:.1f} ms/step" if "isolated_ms" in rows[-1] else rows[-1]["error"]
        print(f"  alone: {size.model:<10} {run.name:<22} stage {run.stage}: {shown} ({time.monotonic() - started:.0f} s)",
              flush=True)
    ran = [(run, row) for run, row in zip(runs, rows) if "isolated_ms" in row]
    started = time.monotonic()
    timeout = size.timeout_s * max(1, len(ran))
    outcome = spawn("interleaved", [run for run, _ in ran], size, timeout) if ran else {"error": "nothing ran"}
    add_interleaved([row for _, row in ran], [run for run, _ in ran], outcome)
    for run, row in ran:
        shown = f"{row['step_ms']:.1f} ms/step" if "step_ms" in row else row["interleaved_error"]
        print(f"  interleaved: {size.model:<10} {run.name:<22} stage {run.stage}: {shown}", flush=True)
    print(f"  (interleaved phase {time.monotonic() - started:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = f"Train-step benchmark, {args.date}: {machine_line()}"
    print(header, flush=True)
    rows = []
    for size_name in args.sizes:
        size = SIZES[size_name]
        if args.timed_steps:
            size = dataclasses.replace(size, timed_steps=args.timed_steps)
        rows += run_size(size, args.frameworks)
    add_ratios(rows)
    text = markdown(rows, header)
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.date}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    (args.out / f"{args.date}.md").write_text(text + "\n")
    print(f"wrote {args.out / (args.date + '.json')} and {args.out / (args.date + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
