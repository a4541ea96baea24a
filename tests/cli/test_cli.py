"""The CLI end to end: `zerodist run` over torchrun, `doctor`, `config show`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.processes import run_group

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _zerodist(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return run_group([sys.executable, "-m", "zerodist", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_run_launches_two_ranks_that_initialise_on_their_first_collective():
    out = _zerodist("run", "--nproc", "2", "examples/hello_all_reduce.py")
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum of (rank + 1) = 3, ranks gathered = [0.0, 1.0]" in out.stdout


@pytest.mark.slow
def test_doctor_under_run_reports_every_rank():
    out = _zerodist("run", "--nproc", "2", "-m", "zerodist", "doctor", "--size-mib", "1", "--trials", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "world       2 rank(s), backend gloo, joined via torchrun" in out.stdout
    for rank in (0, 1):
        assert f"rank   {rank} on" in out.stdout
    assert out.stdout.count("result ok") == 2


def test_doctor_alone_is_a_one_process_world():
    out = _zerodist("doctor", "--size-mib", "1", "--trials", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "launch vars none (one-process world)" in out.stdout and "1 rank(s)" in out.stdout


@pytest.mark.slow
def test_run_reports_a_failing_rank_with_nonzero_exit(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, zerodist.comm as c\nc.barrier()\nif os.environ['RANK'] == '1':\n"
                      "    raise SystemExit('rank 1 gives up')\nc.barrier()\n")
    env_timeout = "5"
    out = run_group([sys.executable, "-m", "zerodist", "run", "--nproc", "2", str(script)], capture_output=True,
                         text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "ZERODIST_TIMEOUT": env_timeout})
    assert out.returncode != 0
    assert "rank 1 gives up" in out.stderr


@pytest.mark.slow
def test_run_keep_heap_gives_every_rank_glibcs_variables_and_keeps_the_users(tmp_path):
    from zerodist.cli.run import KEEP_HEAP_ENV

    # each rank writes its own file (two ranks printing to one pipe interleave their words)
    script = tmp_path / "heap_env.py"
    script.write_text("import json, os, sys\n"
                      "with open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.json'), 'w') as f:\n"
                      "    json.dump({k: v for k, v in os.environ.items() if k.startswith('MALLOC_')}, f)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base = [sys.executable, "-m", "zerodist", "run", "--nproc", "2"]

    def seen(out_dir) -> list[dict]:
        return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    (tmp_path / "kept").mkdir()
    kept = run_group([*base, "--keep-heap", str(script), str(tmp_path / "kept")], capture_output=True, text=True,
                     timeout=120, cwd=REPO, env={**env, "PYTHONPATH": REPO, "MALLOC_TOP_PAD_": "12345"})
    assert kept.returncode == 0, kept.stderr[-2000:]
    expected = {**KEEP_HEAP_ENV, "MALLOC_TOP_PAD_": "12345"}  # the user's own value stays
    assert seen(tmp_path / "kept") == [expected, expected]
    (tmp_path / "plain").mkdir()
    plain = run_group([*base, str(script), str(tmp_path / "plain"), "--keep-heap"], capture_output=True, text=True,
                      timeout=120, cwd=REPO, env={**env, "PYTHONPATH": REPO})
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert seen(tmp_path / "plain") == [{}, {}]  # a script's own "--keep-heap" argument is the script's


def test_config_show_resolves_and_rejects(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                                "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    out = _zerodist("config", "show", str(good), "--world-size", "4")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["train_micro_batch_size_per_gpu"] == 4 and shown["zero_optimization"]["reduce_bucket_size"] == 500000000
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stge": 2}}))
    out = _zerodist("config", "show", str(bad))
    assert out.returncode == 2 and "zero_optimization.stge" in out.stderr and "did you mean 'stage'" in out.stderr
    assert "Traceback" not in out.stderr
