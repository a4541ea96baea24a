"""Peak RSS of training with the optimizer state (and parameter shards) in swap files, against the
same run without: the RSS comparisons moved out of tests/offload/test_offload_memory.py (issue 37:
process RSS on a shared 2-core machine is not a quantity a test can compare by a few percent).

    python benchmarks/offload_memory_bench.py [--repeats 3]

Runs tests/offload/offload_memory_script.py (the 29M-parameter MLP, 2 ranks) in each mode,
`--repeats` times interleaved, and prints per rank the peak RSS, the training peak and the largest
RSS between steps, with the median difference of each mode from the in-memory run (stage 2) or
from `nvme3` (stage 3, for `param`). A benchmark, not a test: it never fails on the figures.
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

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "offload" / "offload_memory_script.py"
MODES = ("memory", "nvme", "nvme3", "param")
FIELDS = ("peak_rss", "train_peak_rss", "step_rss")


def run(mode: str, scratch: Path, index: int) -> list[dict]:
    out = scratch / f"{mode}-{index}"
    nvme = scratch / "nvme"
    nvme.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", str(SCRIPT), mode, str(nvme), str(out), "0"]
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "MALLOC_ARENA_MAX": "2"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.repeats):
            for mode in MODES:
                results[mode].append(run(mode, Path(scratch), index))
    for mode, baseline in (("nvme", "memory"), ("param", "nvme3")):
        for field in FIELDS:
            drops = [b[r][field] - m[r][field] for b, m in zip(results[baseline], results[mode]) for r in range(2)]
            print(f"{mode:>6} vs {baseline:<6} {field:>15}: median {statistics.median(drops) / 2**20:7.1f} MiB lower "
                  f"(min {min(drops) / 2**20:.1f}, max {max(drops) / 2**20:.1f}, {len(drops)} rank-runs)")


if __name__ == "__main__":
    main()
