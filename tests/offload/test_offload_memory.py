"""With `offload_optimizer: nvme` and sub-groups of 5e5 elements, the Adam state (8Ψ/N bytes per rank
in fp32) leaves memory for the swap files by the engine's own counts, and a run whose in-memory
state does not fit a cap on each rank's address space trains under that cap with offload.

No assertion here is on RSS (issue 37: RSS on a shared 2-core machine moved by more than the 10 MB
a test compared); benchmarks/offload_memory_bench.py runs the same script and reports RSS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.offload import offload_memory_script as script
from tests.checkpoint_procs import launch
from tests.processes import run_group

PARAMS = 256 * 3750 + 3750 + 3750 * 3750 + 3750 + 3750 * 3751 + 3751 + 3751 * 16 + 16  # 29.2M
ADAM_PER_RANK = 8 * PARAMS // 2


def _run(tmp_path: Path, mode: str, cap: int) -> list[dict]:
    out = tmp_path / f"{mode}-{cap}"
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", script.__file__, mode, str(nvme), str(out),
               str(cap)]
    done = run_group(command, timeout=240, env={**_env(), "MALLOC_ARENA_MAX": "2"})
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)
               if Path(f"{out}.rank{r}.json").exists()]
    if cap == 0:
        assert done.returncode == 0, done.stderr[-3000:]
    return reports


def _run_forked(tmp_path: Path, mode: str) -> list[dict]:
    """The script's run without a cap on 2 ranks forked from the warm forkserver: for the engine's byte
    counts, which no allocator setting or address-space cap touches (the capped runs above need fresh
    interpreters: MALLOC_ARENA_MAX acts at a process's start)."""
    out, nvme = tmp_path / mode, tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    launch(script.main, 2, [mode, str(nvme), str(out), "0"], timeout=240).check()
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.mark.slow
def test_nvme_offload_lowers_peak_rss_and_trains_under_a_cap_the_in_memory_run_exceeds(tmp_path):
    memory, nvme = _run(tmp_path, "memory", 0), _run(tmp_path, "nvme", 0)
    for in_memory, offloaded in zip(memory, nvme):  # the engine's counts: the whole Adam state moved to the files
        assert in_memory["optimizer_bytes"] - offloaded["optimizer_bytes"] >= 0.99 * ADAM_PER_RANK, (in_memory, offloaded)
        assert offloaded["swapped_bytes"] >= 0.99 * ADAM_PER_RANK and in_memory["swapped_bytes"] == 0, offloaded
    # The cap: halfway between the two runs' growth of the address space after initialize().
    # (The address space, unlike RSS, also holds what the allocator reserved: the gap measured 58-60 MB
    # of the 117 MB state, so a quarter of the state is asked here, enough room for a cap between.)
    grown = [max(r["peak_vm"] - r["at_cap"] for r in reports) for reports in (memory, nvme)]
    assert grown[0] - grown[1] >= ADAM_PER_RANK // 4, grown
    cap = (grown[0] + grown[1]) // 2
    capped_memory = _run(tmp_path, "memory", cap)
    assert any(r["error"] and "allocate" in r["error"] for r in capped_memory), capped_memory
    capped_nvme = _run(tmp_path, "nvme", cap)
    assert [r["steps"] for r in capped_nvme] == [script.STEPS] * 2 and not any(r["error"] for r in capped_nvme)


@pytest.mark.slow
def test_offload_param_lowers_the_training_peak_rss_by_about_the_parameter_shard(tmp_path):
    # Stage 3, a unit per layer, both with the optimizer state in swap files; with offload_param the
    # fp32 shard (4Ψ/N = 58 MB per rank) is in them too, read into each gathered buffer only. The
    # engine's own count of the parameter bytes it holds must drop by the whole shard (all but the
    # biases, which stay whole: persistent), and the swap files grow by it. RSS (measured on a quiet
    # machine 40 MB lower; under load it moved by more than that) is benchmarks/offload_memory_bench.py's.
    optimizer_only, both = _run_forked(tmp_path, "nvme3"), _run_forked(tmp_path, "param")
    shard = 4 * PARAMS // 2
    for with_shard, without in zip(optimizer_only, both):
        assert with_shard["param_bytes"] - without["param_bytes"] >= 0.99 * shard, (with_shard, without)
        assert without["swapped_bytes"] - with_shard["swapped_bytes"] >= 0.99 * shard, (with_shard, without)
