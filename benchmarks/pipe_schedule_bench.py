"""Pipeline schedules: the simulator's bubble and memory per schedule, a threaded replay of each
schedule with sleeps, and the cost of building and checking a schedule.

    python benchmarks/pipe_schedule_bench.py                 # the acceptance grid, 50 ms unit
    python benchmarks/pipe_schedule_bench.py --unit-ms 10 --no-replay

1. Simulator (`zerodist.pipe.simulate`, cost model F = I = W = 1, B = 2, interleaved stages at
   1/v): makespan, idle share against the closed-form bubble, makespan as a ratio of 1F1B's at
   the same (p, m) (the baseline), peak stashed activations per rank.
2. Threaded replay: one thread per pipe rank walks its action list; a compute action sleeps its
   cost x `--unit-ms`, a SEND puts its message in a mailbox, a RECV blocks on it. No processes
   and no tensors, so it checks the timing model itself (does running the lists concurrently
   with blocking receives take the simulated time?) and gives the executor's sleep benchmark a
   reference that shares none of its machinery. It reports wall time / simulated makespan and
   the idle share measured from the replay's own trace (`measure_timeline`).
3. Build + check time of the largest schedules (pure Python; the executor builds once per run).
4. The split's price (`--split-price`): the executor runs an I directly followed by its own W
   as one B (`fuse_split_backward`); where a schedule keeps them apart, a CPU pays for it (I + W
   measured 1.05-1.10x one B: W's matmuls read operands the input pass has pushed out of the
   caches, and write into memory that is not the last freed). The simulator, with each split I
   and W costing (1 + s) units, gives each schedule's step over `local` (its ranks' compute
   alone) at 2 ranks, and the s at which ZB-H1 stops beating 1F1B.
5. With DeepSpeed importable (`DS_ACCELERATOR=cpu /work/venv-ds/bin/python benchmarks/...`):
   whether DeepSpeed's TrainSchedule runs F and B in our 1F1B's order on every stage.

The replay's ratios move with the machine's load (threads wake late): on the shared 2-core
machine, 1.00-1.03 for most rows and up to 1.17 under a load average of 11.

A benchmark, not a test: it prints and never fails on speed. Writes
benchmarks/results/pipe-schedules-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

from zerodist.pipe import (
    Action,
    Costs,
    Kind,
    TimedAction,
    build_schedule,
    check_schedule,
    measure_timeline,
    simulate,
)

RESULTS = Path(__file__).resolve().parent / "results"

# (name, p, m, v): the acceptance grid of issue 25, plus a larger pipe.
GRID = [(name, p, m, 1) for p, m in ((2, 4), (4, 8), (8, 16)) for name in ("gpipe", "1f1b", "zb")] + [
    ("interleaved", p, m, 2) for p, m in ((2, 4), (4, 8), (8, 16))]


def formula(name: str, p: int, m: int, v: int) -> float:
    """The bubble share of wall time under the cost model (ZB-H1's needs m >= p)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * m + p - 1)


def costs_for(v: int, unit: float = 1.0) -> Costs:
    return Costs(forward=unit, backward=2 * unit, backward_input=unit, backward_weight=unit,
                 stage_scale=1 / v)


def _message(action: Action) -> tuple[str, int, int]:
    # The receiving stage names a message (as in schedule_checks).
    if action.kind is Kind.SEND_F:
        return ("F", action.stage + 1, action.microbatch)
    if action.kind is Kind.SEND_B:
        return ("B", action.stage - 1, action.microbatch)
    return ("F" if action.kind is Kind.RECV_F else "B", action.stage, action.microbatch)


def replay(schedule: list[list[Action]], costs: Costs) -> list[list[TimedAction]]:
    """Run every rank's list in its own thread with sleeps; return each rank's timed actions."""
    mailbox: dict[tuple[str, int, int], threading.Event] = {}
    lock = threading.Lock()
    trace: list[list[TimedAction]] = [[] for _ in schedule]
    start_gate = threading.Barrier(len(schedule))

    def event(key: tuple[str, int, int]) -> threading.Event:
        with lock:
            return mailbox.setdefault(key, threading.Event())

    def run(rank: int) -> None:
        start_gate.wait()
        for action in schedule[rank]:
            begin = time.perf_counter()
            if action.kind.is_recv:
                if not event(_message(action)).wait(timeout=60):
                    raise RuntimeError(f"rank {rank} waited 60 s on {action}")
            elif action.kind.is_send:
                event(_message(action)).set()
            else:
                time.sleep(costs.of(action))
            trace[rank].append(TimedAction(action, begin, time.perf_counter()))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(schedule))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return trace


def bench_one(name: str, p: int, m: int, v: int, unit: float, do_replay: bool) -> dict[str, Any]:
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
    simulated = check_schedule(schedule, num_microbatches=m, costs=costs_for(v))
    baseline = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m), costs_for(1))
    row: dict[str, Any] = {
        "schedule": name, "p": p, "m": m, "v": v, "makespan": simulated.makespan,
        "idle_share": simulated.idle_share, "formula": formula(name, p, m, v),
        "vs_1f1b": simulated.makespan / baseline.makespan,
        "peak_by_rank": list(simulated.peak_activations_by_rank),
    }
    if do_replay:
        measured = measure_timeline(replay(schedule, costs_for(v, unit)))
        row["replay_wall_s"] = measured.makespan
        row["replay_vs_sim"] = measured.makespan / (simulated.makespan * unit)
        row["replay_idle_share"] = measured.idle_share
    return row


def bench_build(p: int, m: int) -> dict[str, Any]:
    timings = {}
    for name, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        begin = time.perf_counter()
        schedule = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        built = time.perf_counter()
        check_schedule(schedule, num_microbatches=m)
        timings[name] = {"build_ms": 1e3 * (built - begin), "check_ms": 1e3 * (time.perf_counter() - built),
                         "actions": sum(len(actions) for actions in schedule)}
    return {"p": p, "m": m, "timings": timings}


def compare_deepspeed() -> dict[str, Any] | None:
    """Whether DeepSpeed's TrainSchedule (its only training schedule, 1F1B in lock-step slots)
    runs forwards and backwards in our 1F1B's order on every stage; None without DeepSpeed
    (run this script with /work/venv-ds/bin/python and DS_ACCELERATOR=cpu to include it)."""
    try:
        import deepspeed
        from deepspeed.runtime.pipe import schedule as ds_schedule
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    agree = {}
    for p, m in ((2, 4), (4, 8), (3, 5), (4, 2)):
        ours = build_schedule("1f1b", num_ranks=p, num_microbatches=m, with_communication=False)
        for stage in range(p):
            kinds = [type(command).__name__ for step in ds_schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
                     for command in step]
            theirs = [{"ForwardPass": "F", "BackwardPass": "B"}[k] for k in kinds if k in ("ForwardPass", "BackwardPass")]
            agree[f"p={p} m={m} stage {stage}"] = theirs == [a.kind.value for a in ours[stage]]
    return {"deepspeed": deepspeed.__version__, "same_order": agree}


def markdown(rows: list[dict[str, Any]], builds: list[dict[str, Any]], unit_ms: float) -> str:
    lines = [f"Cost model F = I = W = 1, B = 2 (interleaved stages x 1/v); replay unit {unit_ms} ms.", "",
             "| schedule | p | m | v | makespan | idle share | formula | vs 1F1B | peak stash by rank |"
             " replay / sim | replay idle share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        replayed = (f"{r['replay_vs_sim']:.3f} | {r['replay_idle_share']:.4f}"
                    if "replay_vs_sim" in r else "- | -")
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['makespan']:g} | "
                     f"{r['idle_share']:.4f} | {r['formula']:.4f} | {r['vs_1f1b']:.3f} | "
                     f"{r['peak_by_rank']} | {replayed} |")
    lines += ["", "| p | m | schedule | actions | build ms | check + simulate ms |", "| --- | --- | --- | --- | --- | --- |"]
    for b in builds:
        for name, t in b["timings"].items():
            lines.append(f"| {b['p']} | {b['m']} | {name} | {t['actions']} | {t['build_ms']:.1f} | {t['check_ms']:.1f} |")
    return "\n".join(lines)


def split_price(penalties: tuple[float, ...] = (0.0, 0.03, 0.05, 0.08, 0.10)) -> str:
    """Step over local at 2 ranks when each I and W that the executor keeps apart costs 1 + s."""
    from zerodist.pipe.executor import fuse_split_backward

    def x_local(name: str, m: int, s: float) -> float:
        v = 2 if name in ("zbv", "dualpipev") else 1
        schedule = build_schedule(name, num_ranks=2, num_microbatches=m, stages_per_rank=v)
        costs = Costs(backward_input=1 + s, backward_weight=1 + s, stage_scale=1 / v)
        return simulate([fuse_split_backward(actions) for actions in schedule], costs).makespan / (3 * m)

    def break_even(m: int) -> float:
        low, high = 0.0, 0.5
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if x_local("zb", m, middle) < x_local("1f1b", m, middle) else (low, middle)
        return low

    names = ("1f1b", "zb", "zbv", "dualpipev")
    lines = ["| m | s | " + " | ".join(names) + " |", "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for m in (8, 16):
        for s in penalties:
            lines.append(f"| {m} | {s:.2f} | " + " | ".join(f"{x_local(n, m, s):.3f}" for n in names) + " |")
    lines += ["", "ZB-H1 beats 1F1B while s < " + ", ".join(f"{break_even(m):.3f} (m = {m})" for m in (8, 16))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit-ms", type=float, default=50.0, help="replay time of one F (ms)")
    parser.add_argument("--no-replay", action="store_true", help="simulator only")
    parser.add_argument("--split-price", action="store_true",
                        help="only the split's price: step over local at 2 ranks as the split costs more")
    args = parser.parse_args()
    if args.split_price:
        print(split_price())
        return
    unit = args.unit_ms / 1e3
    rows = [bench_one(*case, unit=unit, do_replay=not args.no_replay) for case in GRID]
    builds = [bench_build(p, m) for p, m in ((8, 64), (16, 128))]
    report = markdown(rows, builds, args.unit_ms)
    deepspeed = compare_deepspeed()
    if deepspeed is not None:
        same = all(deepspeed["same_order"].values())
        report += (f"\n\nDeepSpeed {deepspeed['deepspeed']} TrainSchedule: F/B order "
                   f"{'equals' if same else 'DIFFERS from'} 1f1b's on every stage of "
                   f"{len(deepspeed['same_order'])} (p, m, stage) cases.")
    print(report)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"pipe-schedules-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"unit_ms": args.unit_ms, "rows": rows, "builds": builds, "deepspeed": deepspeed}, indent=1))
    stem.with_suffix(".md").write_text(report + "\n")


if __name__ == "__main__":
    main()
