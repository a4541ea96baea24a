"""`zerodist bench comm`: sizes, conventions, result checks, and the spawned two-rank run end to end."""

from __future__ import annotations

import csv
import json
import os
import sys

import pytest

import zerodist.comm as comm
from zerodist.bench.comm import BenchOptions, parse_bytes, power_of_two_sizes, run_comm_bench
from tests.harness import distributed_test
from tests.processes import run_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "ZERODIST_COLLECTIVE_GUARD")


@pytest.mark.unit
@pytest.mark.parametrize("text, value", [("1K", 1024), ("64M", 64 * 2**20), ("64MiB", 64 * 2**20), ("512", 512),
                                         ("1g", 2**30), ("2KB", 2048)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.unit
def test_parse_bytes_rejects_and_sizes_are_powers_of_two():
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("1.5M")
    assert power_of_two_sizes(1000, 8192) == [1024, 2048, 4096, 8192]
    assert power_of_two_sizes(1, 4) == [1, 2, 4]
    with pytest.raises(ValueError, match="larger than"):
        power_of_two_sizes(4096, 1024)


@distributed_test(world_size=[2, 4])
def test_every_op_is_correct_and_follows_nccl_tests_conventions(world_size):
    n = world_size
    options = BenchOptions(min_bytes=64, max_bytes=256, trials=2, warmups=1, dtype="bfloat16", compare_raw=True)
    rows = run_comm_bench(options)
    assert {r.op for r in rows} == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"}
    assert all(r.correct for r in rows), [(r.op, r.num_bytes) for r in rows if not r.correct]
    for r in rows:
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * comm.bus_factor(r.op, n))
        assert r.num_bytes == r.numel * 2 and r.ratio > 0 and r.raw_busbw_gbps > 0
    assert [r.num_bytes for r in rows if r.op == "all_reduce"] == [64, 128, 256]


@pytest.mark.multiprocess
def test_spawned_two_rank_run_writes_csv_json_png(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = run_group(
        [sys.executable, "-m", "zerodist", "bench", "comm", "--nproc", "2", "--min-bytes", "1K", "--max-bytes", "4K",
         "--trials", "3", "--warmups", "1", "--out", str(tmp_path), "--compare-raw"],
        env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 ranks, backend gloo" in out.stdout and "zd/raw" in out.stdout and "2S/t" in out.stdout
    with open(tmp_path / "bench_comm.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 * 3  # five ops x 1K, 2K, 4K
    assert {row["correct"] for row in rows} == {"ok"}
    assert all(float(row["busbw_gbps"]) > 0 and float(row["zerodist_over_raw"]) > 0 for row in rows)
    meta = json.loads((tmp_path / "bench_comm.json").read_text())["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo"
    assert (tmp_path / "bench_comm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
