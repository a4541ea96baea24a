"""The 25.5M step time of this tree against another git ref, ZeRO stages 0-3, with CPU time per
step as the measure (the machine may be loaded: wall time then measures the neighbours).

    python benchmarks/compare_trees.py REF                 # e.g. main, or a commit
    python benchmarks/compare_trees.py REF --rounds 4 --timed-steps 8

Checks REF out in a temporary `git worktree` and alternates, round after round, one
`benchmarks/train_bench.py --phase interleaved --runs 1 --sizes bench-25m --configs ddp
zerodist-0 .. zerodist-3` run with this tree's zerodist and one with REF's (PYTHONPATH; the
benchmark's own code is this tree's). Each run gives each stage's CPU time (summed over the 2
ranks) as a ratio to DDP in the same processes; the table is the median over rounds of those
ratios per tree, and this tree's over REF's (issue 31's acceptance: within 1.03 at every stage).
Writes each run's JSON under benchmarks/results/compare-<ref>/. Never fails on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STAGES = (0, 1, 2, 3)


def run_bench(tree: Path, out: Path, name: str, timed_steps: int, size: str) -> dict[int, float]:
    """One interleaved run with `tree`'s zerodist: each stage's CPU-time ratio to DDP."""
    configs = ["ddp"] + [f"zerodist-{s}" for s in STAGES]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(HERE / "train_bench.py"), "--phase", "interleaved", "--runs", "1",
                    "--sizes", size, "--timed-steps", str(timed_steps), "--configs", *configs,
                    "--out", str(out), "--date", name], check=True, env=env, cwd=ROOT)
    rows = json.loads((out / f"{name}.json").read_text())["rows"]
    return {r["stage"]: r["cpu_vs_ddp"] for r in rows if r["framework"] != "ddp" and r.get("cpu_vs_ddp")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", help="the git ref to compare with (a branch, tag or commit)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of (this tree, REF)")
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--size", default="bench-25m", help="train_bench.py's size (bench: a smoke run)")
    args = parser.parse_args()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.ref)
    out = HERE / "results" / f"compare-{safe}"
    ratios: dict[str, list[dict[int, float]]] = {"this tree": [], args.ref: []}
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.ref], check=True)
        try:
            for round_ in range(args.rounds):
                ratios["this tree"].append(run_bench(ROOT, out, f"this-{round_}", args.timed_steps, args.size))
                ratios[args.ref].append(run_bench(other, out, f"ref-{round_}", args.timed_steps, args.size))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    median = {tree: {s: statistics.median(r[s] for r in runs if s in r) for s in STAGES} for tree, runs in ratios.items()}
    print(f"\nCPU time per step (2 ranks summed) / DDP's in the same run, median of {args.rounds} rounds, {args.size}:")
    print("| tree | " + " | ".join(f"stage {s}" for s in STAGES) + " |")
    print("| --- |" + " --- |" * len(STAGES))
    for tree, by_stage in median.items():
        print(f"| {tree} | " + " | ".join(f"{by_stage[s]:.3f}" for s in STAGES) + " |")
    print("| this / ref | " + " | ".join(f"{median['this tree'][s] / median[args.ref][s]:.3f}" for s in STAGES) + " |")


if __name__ == "__main__":
    main()
