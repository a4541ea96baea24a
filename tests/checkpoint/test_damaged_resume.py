"""A damaged shard in the newest checkpoint is treated as a damaged manifest is: the error names
the damage, the newest intact tag and how to resume from it; `checkpoint.skip_damaged: true`
loads the intact one (one warning line), also in an automatic restart, which then ends where
the uninterrupted run ends."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.checkpoint.test_manifest_integrity import load_body, save_body
from tests.checkpoint_procs import launch
from tests.harness import run_distributed
from tests.processes import run_group


def _truncate_rank1_shard(tag_dir) -> str:
    shard = next(tag_dir.glob("shard-r00001-*.bin"))
    shard.write_bytes(shard.read_bytes()[:50])
    return shard.name


@pytest.mark.multiprocess
def test_a_damaged_newest_shard_names_the_intact_tag_and_skip_damaged_loads_it(tmp_path, caplog):
    run_distributed(save_body, 2, str(tmp_path), 3)
    name = _truncate_rank1_shard(tmp_path / "global_step3")
    for message in run_distributed(load_body, 2, str(tmp_path)):
        assert message.startswith("CheckpointCorruptError: the newest checkpoint in"), message
        assert f"global_step3: {tmp_path / 'global_step3' / name}: truncated, 50 bytes" in message
        assert "newest intact checkpoint is global_step2 (step 2)" in message
        assert "tag='global_step2'" in message and "skip_damaged: true" in message
    assert run_distributed(load_body, 2, str(tmp_path), None, True) == ["global_step2"] * 2
    name2 = _truncate_rank1_shard(tmp_path / "global_step2")  # two damaged: the third newest loads
    assert run_distributed(load_body, 2, str(tmp_path), None, True) == ["global_step1"] * 2
    message = run_distributed(load_body, 2, str(tmp_path))[0]
    assert "global_step3: " in message and f"global_step2: {tmp_path / 'global_step2' / name2}" in message
    assert "newest intact checkpoint is global_step1" in message
    # a tag asked for by name loads or fails: never another one
    assert "global_step3 is damaged" in run_distributed(load_body, 2, str(tmp_path), "global_step3", True)[0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_restart_after_a_truncated_newest_shard_resumes_from_the_intact_tag(tmp_path):
    """`zerodist run --max-restarts 2` with `auto_resume` and `skip_damaged: true`: rank 1 truncates
    its shard of global_step6 and dies after step 7; the restart loads global_step4 and the job
    ends with the uninterrupted run's parameters and loss."""
    from tests import checkpoint_restart_script as script

    out = tmp_path / "final.pt"
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", "--max-restarts", "2",
               script.__file__, str(tmp_path / "ckpt"), str(out), "7", "damage"]
    done = run_group(command, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "final.pt.log").read_text().splitlines() == ["attempt 0 started at step 0",
                                                                    "attempt 1 started at step 4"]
    warnings = [line for line in done.stderr.splitlines() if "skip_damaged" in line]
    assert len(warnings) == 1 and "loading global_step4 (step 4)" in warnings[0] and "global_step6 (" in warnings[0]
    reference_state, reference_loss = launch(script.train, 2, None, None).check()[0]
    final = torch.load(out, weights_only=True)
    assert final["loss"] == reference_loss
    for key in reference_state:
        assert torch.equal(final["state"][key], reference_state[key]), key
