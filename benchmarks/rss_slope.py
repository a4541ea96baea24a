"""RSS growth per step of the `zerodist train` demo (issue 37's creep), from its own metrics.csv.

    python benchmarks/rss_slope.py                                   # tiny GPT, stage 3, 2000 steps, 2 ranks
    python benchmarks/rss_slope.py --steps 1500 --rounds 2 --tree /path/to/an/older/checkout

Each run is `python -m zerodist train --model tiny --stage 3 --steps N` in a fresh process group;
rank 0's `rss_mib` column (one row a step, 0.1 MiB resolution) is fitted by least squares from
step `--skip` on (start-up, the first gathers and the allocator's warm-up come before), and the
slope is printed in bytes per step, over the whole fit and over its second half alone: growth that
is the allocator settling (arenas and the heap's high-water mark filling) is in the first half and
gone from the second; a leak (objects kept per step) grows at the same rate in both. Variants, taking turns round by round (the machine is shared):

    default             as a user runs it
    MALLOC_ARENA_MAX=1  one glibc arena for every thread: growth that disappears here is the
                        allocator spreading frees over per-thread arenas (fragmentation), not
                        objects kept alive

`--tree` runs the same variants again with another checkout's zerodist on PYTHONPATH (an older
commit, for a before/after in the same run). A benchmark, not a test: RSS on a shared machine is
not a quantity a test can compare ([Note: bounded step history] in zerodist/train/metrics.py is
the exact count tests/train/test_step_history.py checks).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"default": {}, "MALLOC_ARENA_MAX=1": {"MALLOC_ARENA_MAX": "1"}}


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (x, y)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def one_run(tree: Path, env_extra: dict[str, str], steps: int, skip: int,
            stage: int) -> tuple[float, float, float, float]:
    """(bytes per step after `skip`, RSS at `skip` and at the end in MiB, bytes per step over the second
    half of the steps after `skip`) of one demo run."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        env.update(env_extra, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, "-m", "zerodist", "train", "--model", "tiny", "--stage", str(stage),
                        "--steps", str(steps), "--nproc", "2", "--out", out], cwd=tree, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30 * 60)
        with open(Path(out) / "metrics.csv", encoding="utf-8") as f:
            rows = [(int(r["step"]), float(r["rss_mib"])) for r in csv.DictReader(f)]
    kept = [(step, mib * 2**20) for step, mib in rows if step >= skip]
    late = [(step, rss) for step, rss in kept if step >= (skip + steps) // 2]
    return slope(kept), kept[0][1] / 2**20, kept[-1][1] / 2**20, slope(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--skip", type=int, default=300, help="fit from this step on (default 300)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", type=Path, help="also run another checkout's zerodist (before/after)")
    args = parser.parse_args()
    trees = {"this tree": REPO, **({f"{args.tree}": args.tree.resolve()} if args.tree else {})}
    results: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for round_ in range(args.rounds):
        for tree_name, tree in trees.items():
            for variant, env_extra in VARIANTS.items():
                result = one_run(tree, env_extra, args.steps, args.skip, args.stage)
                results.setdefault((tree_name, variant), []).append(result)
                print(f"round {round_ + 1}: {tree_name}, {variant}: {result[0]:+.0f} B/step "
                      f"({result[1]:.1f} -> {result[2]:.1f} MiB over steps {args.skip}-{args.steps}; second half "
                      f"{result[3]:+.0f} B/step)", flush=True)
    print(f"\nRSS slope of rank 0, tiny GPT, ZeRO stage {args.stage}, 2 ranks, steps {args.skip}-{args.steps} "
          f"(least squares over metrics.csv's rss_mib; median of {args.rounds} round(s))")
    for (tree_name, variant), runs in results.items():
        slopes, late = sorted(r[0] for r in runs), sorted(r[3] for r in runs)
        print(f"  {tree_name:<24} {variant:<20} {slopes[len(slopes) // 2]:+8.0f} B/step  "
              f"({slopes[len(slopes) // 2] / 1024:+.3f} KiB/step); second half {late[len(late) // 2]:+.0f} B/step")


if __name__ == "__main__":
    main()
