"""The GPU tier in one command: its tests, then the one-rank overhead benchmark, and a table to paste.

    python benchmarks/gpu_tier.py                  # (or python -m benchmarks.gpu_tier) on a CUDA machine
    python benchmarks/gpu_tier.py --quick          # the tiny GPT and 3 rounds: a check of the script itself

1. The GPU tier's tests: tests/gpu (the `gpu`-marked ones, and the CPU checks beside them) and
   tests/offload/test_host_offload.py, under a deadline; passed, failed and skipped counted from
   pytest's summary.
2. The overhead benchmark (one rank, one process, `--part overhead`): the "bench-25m" GPT (25.5M
   parameters), micro-batch 8 x 256 tokens, fp32 and bf16, AdamW; a plain loop (the model on the
   device, torch's AdamW, no zerodist) and ZeRO stages 1, 2 and 3, all built first and stepped in
   interleaved rounds (plain, 1, 2, 3, plain, ...), each step timed between two device
   synchronisations; the median over rounds of each arm's step time and its ratio to the plain loop's
   in the same round. With `offload_optimizer: cpu` at stage 2 as one more arm (the host step).
3. Prints both as markdown for benchmarks/README.md, and writes benchmarks/results/gpu-tier-<date>.md.

Everything runs on whatever device torch finds: without CUDA the tests skip with their reason and
the benchmark measures the CPU (as a check of the script, not a GPU figure; the table says which).
Budget: under 8 minutes on one GPU (tests ~3 min, benchmark ~2 min); each part has its own deadline.
A benchmark, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TEST_DEADLINE_S, BENCH_DEADLINE_S, TEST_TIMEOUT_S = 300, 240, 150
ARMS = ("plain", "zero-1", "zero-2", "zero-3", "zero-2 + offload_optimizer cpu")


def _python_path() -> str:
    """The repository first, then the caller's PYTHONPATH (packages carried to a bare GPU machine, say)."""
    return os.pathsep.join(dict.fromkeys([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))


def run_tests() -> dict[str, Any]:
    """`pytest` on the GPU tier's files; its summary counts and time. pytest writes to
    benchmarks/results/gpu-tier-tests.log as it goes, so a run cut off by the deadline still shows
    which tests failed and why."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}",
               "tests/gpu", "tests/offload/test_host_offload.py"]
    RESULTS.mkdir(exist_ok=True)
    log = RESULTS / "gpu-tier-tests.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        try:
            subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=TEST_DEADLINE_S,
                           env={**os.environ, "PYTHONPATH": _python_path()})
            ended = ""
        except subprocess.TimeoutExpired:
            ended = f"\ntimed out after {TEST_DEADLINE_S} s"
    output = log.read_text(errors="replace") + ended
    last = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {"counts": counts, "seconds": time.perf_counter() - started, "tail": output[-3000:]}


# ---------------------------------------------------------------- the overhead benchmark (one rank)

def _config(stage: int, bf16: bool, offload: bool, micro: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.01}},
            "zero_optimization": zero}


def _arms(preset: str, bf16: bool, micro: int, device: Any) -> dict[str, Any]:
    """Each arm's step function: plain loop, ZeRO 1-3, ZeRO 2 with host offload."""
    import torch

    import zerodist
    from zerodist.models import GPT, gpt_config

    dtype = torch.bfloat16 if bf16 else torch.float32
    steps: dict[str, Any] = {}
    torch.manual_seed(0)
    plain = GPT(gpt_config(preset)).to(device, dtype)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    tokens = torch.randint(0, 256, (micro, plain.config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)

    def plain_step() -> None:
        plain(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps["plain"] = plain_step
    for name, stage, offload in (("zero-1", 1, False), ("zero-2", 2, False), ("zero-3", 3, False),
                                 ("zero-2 + offload_optimizer cpu", 2, True)):
        torch.manual_seed(0)
        engine = zerodist.initialize(model=GPT(gpt_config(preset)), config=_config(stage, bf16, offload, micro))[0]

        def zero_step(engine: Any = engine) -> None:
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        steps[name] = zero_step
    return steps


def overhead(preset: str, rounds: int, warmup: int, micro: int, out: str) -> None:
    """One rank in this process: every arm built, then stepped in interleaved rounds."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    import torch

    import zerodist.comm as comm
    from zerodist.accelerator import get_accelerator

    comm.init_distributed()
    device, accelerator = comm.device_for_rank(), get_accelerator()
    rows = []
    for bf16 in (False, True):
        arms = _arms(preset, bf16, micro, device)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for index in range(warmup + rounds):
            for name, step in arms.items():
                accelerator.synchronize()
                started = time.perf_counter()
                step()
                accelerator.synchronize()
                if index >= warmup:
                    times[name].append(time.perf_counter() - started)
        for name in arms:
            ratios = [t / p for t, p in zip(times[name], times["plain"])]
            rows.append({"precision": "bf16" if bf16 else "fp32", "arm": name, "step_ms": 1e3 * statistics.median(times[name]),
                         "vs_plain": statistics.median(ratios)})
        del arms
        accelerator.empty_cache()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (no CUDA device: not a GPU figure)"
    Path(out).write_text(json.dumps({"device": name, "backend": comm.ensure_initialized().backend, "rows": rows,
                                     "torch": torch.__version__, "preset": preset, "rounds": rounds, "micro": micro}))


def run_overhead(preset: str, rounds: int, warmup: int, micro: int, simulate: bool = False) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--part", "overhead", "--preset", preset,
                   "--rounds", str(rounds), "--warmup", str(warmup), "--micro", str(micro), "--out", out.name]
        try:
            # --quick without CUDA: the offload arm takes the device-copy path ([Note: a simulated device])
            env = {**os.environ, "PYTHONPATH": _python_path(), **({"ZERODIST_SIMULATED_DEVICE": "1"} if simulate else {})}
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_DEADLINE_S, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {BENCH_DEADLINE_S} s"}
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-3000:]}
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def table(tests: dict[str, Any], bench: dict[str, Any]) -> str:
    counts = tests["counts"]
    lines = [f"## GPU tier (`benchmarks/gpu_tier.py`, {datetime.date.today()})", "",
             f"Tests (pytest tests/gpu and tests/offload/test_host_offload.py): {counts.get('passed', 0)} "
             f"passed, {counts.get('failed', 0) + counts.get('error', 0)} failed, {counts.get('skipped', 0)} skipped "
             f"in {tests['seconds']:.0f} s.", ""]
    if "error" in bench:
        return "\n".join(lines + ["Overhead benchmark failed:", "", "```", bench["error"], "```"])
    lines += [f"One-rank overhead, {bench['device']} ({bench['backend']}, torch {bench['torch']}), GPT "
              f"{bench['preset']}, micro-batch {bench['micro']}, median of {bench['rounds']} interleaved rounds:", "",
              "| precision | arm | step | vs plain loop (same round) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['precision']} | {r['arm']} | {r['step_ms']:.1f} ms | {r['vs_plain']:.3f}x |" for r in bench["rows"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "tests", "overhead"], default="all")
    parser.add_argument("--preset", default="bench-25m")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, 3 rounds: checks the script")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.rounds, args.warmup = "tiny", 3, 1
    if args.part == "overhead":
        overhead(args.preset, args.rounds, args.warmup, args.micro, args.out)
        return
    started = time.perf_counter()
    tests = run_tests() if args.part in ("all", "tests") else {"counts": {}, "seconds": 0.0, "tail": ""}
    print(tests["tail"])
    bench = run_overhead(args.preset, args.rounds, args.warmup, args.micro, args.quick) if args.part == "all" else {
        "error": "not run (--part tests)"}
    text = table(tests, bench)
    print(text)
    print(f"\n(the whole tier took {time.perf_counter() - started:.0f} s)")
    if args.quick:  # a check of the script, not a figure to keep
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gpu-tier-{datetime.date.today()}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
