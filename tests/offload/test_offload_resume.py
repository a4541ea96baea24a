"""Checkpoints with swapped optimizer state: the real state is saved, a resume rebuilds the swap
files, a rank killed mid-step resumes to the uninterrupted run's parameters, and a damaged swap
file is the same named error on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.offload import offload_restart_script as script
from tests.processes import run_group


def _steps(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        generator = torch.Generator().manual_seed(50 * step + engine.global_rank)
        x, y = torch.randn(4, 16, generator=generator), torch.randn(4, 8, generator=generator)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_and_resume_across_offload(save_dir: str, nvme_path: str) -> None:
    import zerodist
    from zerodist.models import make_mlp

    def build(nvme: str | None):
        return zerodist.initialize(model=make_mlp(), config=script.config(None, nvme))[0]

    whole = build(None)
    expected = _steps(whole, 0, 6)
    expected_state = whole.module_state_dict()
    whole.destroy()
    saving = build(nvme_path)  # saves with its state in swap files
    _steps(saving, 0, 3)
    saving.save_checkpoint(save_dir, tag="offloaded")
    saving.destroy()
    for nvme in (None, nvme_path):  # a checkpoint saved with offload resumes with or without it
        resumed = build(nvme)
        resumed.load_checkpoint(save_dir, tag="offloaded")
        if nvme:  # the swap files were rebuilt from the checkpoint, under a new run directory
            assert list(Path(resumed.zero_state.inner_optimizer.directory.path).glob("*.swp"))
        assert _steps(resumed, 3, 6) == expected[3:]
        state = resumed.module_state_dict()
        resumed.destroy()
        for key, value in expected_state.items():
            assert torch.equal(state[key], value), key


def test_checkpoint_saved_with_swapped_state_resumes_with_or_without_offload(tmp_path):
    (tmp_path / "nvme").mkdir()
    run_distributed(_save_and_resume_across_offload, 2, str(tmp_path / "ckpt"), str(tmp_path / "nvme"),
                    timeout=120)


def _truncate_then_step(nvme_path: str) -> str:
    import zerodist
    from zerodist.models import make_mlp
    from zerodist.offload import SwapFileError

    engine = zerodist.initialize(model=make_mlp(), config=script.config(None, nvme_path))[0]
    _steps(engine, 0, 2)
    engine.zero_state.inner_optimizer.settle()  # the last step's writes land before the damage
    if engine.global_rank == 1:
        victim = engine.zero_state.inner_optimizer.directory.file(1)
        with open(victim, "r+b") as file:
            file.truncate(10)
    try:
        _steps(engine, 2, 3)
    except SwapFileError as error:
        return str(error)
    finally:
        engine.destroy()
    raise AssertionError("no error")


def test_truncated_swap_file_is_one_named_error_on_every_rank(tmp_path):
    (tmp_path / "nvme").mkdir()
    messages = run_distributed(_truncate_then_step, 2, str(tmp_path / "nvme"), timeout=60)
    assert "subgroup00001.swp' holds 10 bytes" in messages[1] and "truncated" in messages[1]
    assert messages[0].startswith("on rank 1: swap file") and messages[0].endswith(messages[1])


def _missing_path(nvme_path: str) -> str:
    import zerodist
    from zerodist.models import make_mlp
    from zerodist.offload import SwapPathError

    try:
        zerodist.initialize(model=make_mlp(), config=script.config(None, nvme_path))
    except SwapPathError as error:
        return str(error)
    raise AssertionError("no error")


def test_missing_nvme_path_is_a_named_error_on_every_rank(tmp_path):
    messages = run_distributed(_missing_path, 2, str(tmp_path / "absent"), timeout=60)
    assert messages[0] == messages[1] and "does not exist; create it" in messages[0]


@pytest.mark.slow
def test_rank_killed_mid_step_resumes_to_the_uninterrupted_parameters(tmp_path):
    out, nvme = tmp_path / "final.pt", tmp_path / "nvme"
    nvme.mkdir()
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", "--max-restarts", "1", script.__file__,
               str(tmp_path / "ckpt"), str(nvme), str(out), "5"]
    done = run_group(command, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The killed attempt's swap files are left for inspection, where the start-up line said.
    runs = sorted(p.name for p in nvme.iterdir())
    assert len(runs) == 1 and runs[0] in done.stderr and list((nvme / runs[0]).glob("rank1/*.swp"))
    reference = run_distributed(script.train, 2, None, None, None, timeout=60)[0]  # in memory, never stopped
    final = torch.load(out, weights_only=True)
    for key in reference:
        assert torch.equal(final[key], reference[key]), key


@pytest.mark.unit
def test_ranks_sharing_a_disk_are_checked_together():
    from zerodist.offload.setup import shared_disk_problems

    mib = 2**20
    disk, other = ("node0", 7, 150 * mib), ("node0", 8, 150 * mib)
    problems = shared_disk_problems("/nvme", [(disk, 100 * mib), (disk, 100 * mib)])
    assert [rank for rank, _ in problems] == [0, 1]
    assert "has 150.0 MiB free but the swap files need 200.0 MiB on its disk: ranks [0, 1] share it" in problems[0][1]
    assert shared_disk_problems("/nvme", [(disk, 100 * mib), (other, 100 * mib)]) == []  # two disks
    assert shared_disk_problems("/nvme", [(disk, 70 * mib), (disk, 70 * mib)]) == []  # both fit


def _two_ranks_one_small_disk(nvme_path: str) -> str:
    import zerodist
    from zerodist.models import make_mlp
    from zerodist.offload import SwapSpaceError
    from zerodist.offload import setup

    real = setup.disk_of
    # Room for one rank's files (the MLP's ~1000 elements x 12 bytes per rank), not for both.
    setup.disk_of = lambda root: (*real(root)[:2], 16_000)
    try:
        zerodist.initialize(model=make_mlp(), config=script.config(None, nvme_path))
    except SwapSpaceError as error:
        return str(error)
    finally:
        setup.disk_of = real
    raise AssertionError("no error")


def test_ranks_that_fit_alone_but_not_together_on_one_disk_fail_at_start_on_every_rank(tmp_path):
    (tmp_path / "nvme").mkdir()
    messages = run_distributed(_two_ranks_one_small_disk, 2, str(tmp_path / "nvme"), timeout=60)
    assert messages[0] == messages[1] and "ranks [0, 1] share it" in messages[0]
