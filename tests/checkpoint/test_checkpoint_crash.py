"""Crashes inside a save: kill -9 a rank at every named point of `save_checkpoint`.

For each point: ranks resume from the previous checkpoint (step 3), train to step 6 and save;
one rank SIGKILLs itself at the point. Fresh ranks then load (a) the previous checkpoint by
its tag, which must always load, and (b) the newest committed one, which is the previous one
unless the crash came after the manifest's rename (or killed another rank than 0 after every rank
had reported its files written, when rank 0 still commits); both continue to step 8 and must end
bitwise equal to a run that never stopped.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from tests.checkpoint_procs import launch
from tests.engine_helpers import base_config, global_batch
from zerodist.checkpoint import KILL_ENV, KILL_POINTS, inspect_checkpoints
from zerodist.models import make_mlp
from tests.processes import run_group

pytestmark = pytest.mark.multiprocess

TOTAL_STEPS, PREVIOUS, SAVED = 8, 3, 6
COMMIT_POINT = KILL_POINTS.index("manifest-renamed")  # from here on the new checkpoint is committed
REPORTED = KILL_POINTS.index("after-gather")  # a rank past this has handed rank 0 all it wrote
RANK0_ONLY = {p for p in KILL_POINTS[KILL_POINTS.index("after-gather") + 1: KILL_POINTS.index("before-outcome")]}
# Every point, on rank 1 where every rank passes it (rank 0 where only rank 0 does), and a
# few again on rank 0, which also hosts the store and writes the manifest.
CASES = [(p, 0 if p in RANK0_ONLY else 1) for p in KILL_POINTS] + [
    (p, 0) for p in ("tag-agreed", "shard-partial", "state-synced", "before-gather", "after-gather")]


def _config(save_dir: str | None) -> dict:
    return base_config(2, train_batch_size=8, train_micro_batch_size_per_gpu=None,
                       scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}},
                       # A short agreement deadline: a survivor waiting for a killed peer's tag gives up soon.
                       checkpoint={"keep_last": 2, "save_dir": save_dir, "agreement_timeout": 2} if save_dir else {})


def _engine(save_dir: str | None):
    engine, *_ = zerodist.initialize(model=make_mlp(), config=_config(save_dir))
    return engine


def _train(engine, stop: int) -> dict[str, torch.Tensor]:
    n, rank, micro = comm.get_world_size(), comm.get_rank(), engine.batch.micro_batch_size
    for step in range(engine.global_steps, stop):
        x, y = global_batch(step, micro * n)
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    return engine.module_state_dict()


def prepare_body(save_dir: str) -> None:
    engine = _engine(save_dir)
    for step in (1, PREVIOUS):
        _train(engine, step)
        engine.save_checkpoint(save_dir)


def uninterrupted_body() -> dict[str, torch.Tensor]:
    return _train(_engine(None), TOTAL_STEPS)


def crash_body(save_dir: str, spec: str) -> str:
    engine = _engine(save_dir)
    engine.load_checkpoint(save_dir, tag=f"global_step{PREVIOUS}")
    _train(engine, SAVED)
    os.environ[KILL_ENV] = spec
    try:
        engine.save_checkpoint(save_dir)
    finally:
        del os.environ[KILL_ENV]
    return "not killed"


def resume_body(save_dir: str) -> list[tuple[str, dict[str, torch.Tensor]]]:
    results = []
    for tag in (f"global_step{PREVIOUS}", None):
        engine = _engine(save_dir)
        path, _ = engine.load_checkpoint(save_dir, tag=tag)
        results.append((os.path.basename(path), _train(engine, TOTAL_STEPS)))
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """A save directory holding steps 1 and 3, and the uninterrupted run's final parameters."""
    save_dir = tmp_path_factory.mktemp("crash-template") / "ckpt"
    launch(prepare_body, 2, str(save_dir)).check()
    reference = launch(uninterrupted_body, 2).check()[0]
    return save_dir, reference


CONCURRENT_CASES = 2  # a case whose survivor waits out the agreement timeout is mostly idle


def _crash_and_resume(template, save_dir, point: str, rank: int):
    shutil.copytree(template, save_dir)
    crashed = launch(crash_body, 2, str(save_dir), f"{point}@{rank}", timeout=60)
    if crashed.exitcodes[rank] != -9:
        return save_dir, crashed, None
    return save_dir, crashed, launch(resume_body, 2, str(save_dir), timeout=60)


@pytest.fixture(scope="module")
def crashes(previous, tmp_path_factory):
    """Every case's crash and resume, CONCURRENT_CASES at a time (each in its own directory, with its
    own ranks and port): a case killed on rank 1 spends most of its time with rank 0 waiting out the
    2 s agreement timeout, idle. {(point, rank): future of (save dir, crash launch, resume launch or None)}"""
    template, _ = previous
    with ThreadPoolExecutor(CONCURRENT_CASES) as pool:
        futures = {(point, rank): pool.submit(_crash_and_resume, template,
                                              tmp_path_factory.mktemp(f"crash-{point}-{rank}") / "ckpt", point, rank)
                   for point, rank in CASES}
        wait(futures.values())
    return futures


# The first case's setup runs every case (each launch bounded by its 60 s): pytest's 300 s would count
# them all on a loaded machine.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point,rank", CASES, ids=[f"{p}@{r}" for p, r in CASES])
def test_kill_inside_save_keeps_previous_checkpoint(previous, crashes, point, rank):
    _, reference = previous
    save_dir, crashed, resumed = crashes[(point, rank)].result()  # a case's own error is raised in its test
    assert crashed.exitcodes[rank] == -9, f"rank {rank} was not killed at {point}: {crashed}"
    (old_tag, old_state), (new_tag, new_state) = resumed.check()[0]
    # Rank 0 commits once every rank has reported its files written, even if another rank dies after.
    committed = KILL_POINTS.index(point) >= (COMMIT_POINT if rank == 0 else REPORTED)
    assert old_tag == f"global_step{PREVIOUS}"
    assert new_tag == f"global_step{SAVED if committed else PREVIOUS}"
    for state in (old_state, new_state):
        for key in reference:
            assert torch.equal(state[key], reference[key]), f"{key} differs after resuming ({point}@{rank})"
    reports, _ = inspect_checkpoints(save_dir)
    assert all(not r.problems for r in reports), [r.problems for r in reports]
    assert any(r.tag == f"global_step{SAVED}" and r.committed == committed for r in reports) or not committed


@pytest.mark.slow
def test_dead_rank_is_restarted_and_training_resumes_by_itself(tmp_path):
    """`zerodist run --max-restarts 1` + `checkpoint.auto_resume`: rank 1 dies after step 5; the
    agent restarts the group, initialize() loads step 4 (the newest committed), the job ends
    by itself with the uninterrupted run's parameters."""
    import sys

    from tests import checkpoint_restart_script as script

    out = tmp_path / "final.pt"
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", "--max-restarts", "1",
               script.__file__, str(tmp_path / "ckpt"), str(out), "5"]
    done = run_group(command, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "final.pt.log").read_text().splitlines() == ["attempt 0 started at step 0",
                                                                    "attempt 1 started at step 4"]
    reference = launch(script.train, 2, None, None).check()[0][0]
    final = torch.load(out, weights_only=True)["state"]
    for key in reference:
        assert torch.equal(final[key], reference[key]), key
