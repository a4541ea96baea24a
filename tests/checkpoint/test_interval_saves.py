"""A failed interval save (disk full on one rank) warns on every rank and training goes on; the
next success resets the count; `max_failed_saves` failures in a row stop training by name."""

from __future__ import annotations

import errno
import shutil
import tempfile

import pytest
import torch.nn.functional as F

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.debug_helpers import captured_logs
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test
from zerodist.models import make_mlp

FAILING_STEPS = {2, 4, 5}


@distributed_test(world_size=2, timeout=150)
def test_failed_interval_saves_warn_and_training_goes_on_until_the_limit():
    save_dir = tempfile.mkdtemp(prefix="zerodist-interval-") if comm.get_rank() == 0 else None
    holder = [save_dir]
    comm.broadcast_object_list(holder, src=0)
    save_dir = holder[0]
    config = base_config(1, checkpoint={"save_interval": 1, "save_dir": save_dir, "max_failed_saves": 2})
    engine, *_ = zerodist.initialize(model=make_mlp(), config=config)
    original = ckpt.files.AtomicFile.write

    def write(self, *args, **kwargs):  # rank 1's disk is full at the failing steps
        if comm.get_rank() == 1 and engine.global_steps in FAILING_STEPS:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    ckpt.files.AtomicFile.write = write
    rank = comm.get_rank()
    try:
        with captured_logs() as lines, pytest.raises(ckpt.CheckpointWriteError, match=r"2 interval saves in a row failed \(checkpoint."
                                                            r"max_failed_saves is 2\).*No space left"):
            for step in range(6):
                x, y = global_batch(step, 8)
                engine.backward(F.mse_loss(engine(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]))
                engine.step()
    finally:
        ckpt.files.AtomicFile.write = original
    assert engine.global_steps == 5  # steps 2 and 4 failed to save and training went on
    warned = [line for line in lines if "Training goes on" in line]
    assert len(warned) == 2 and "step 2: save_checkpoint('global_step2') failed" in warned[0], lines
    assert "1 of 2 interval saves failed in a row" in warned[1]  # step 3's success reset the count
    assert [m.tag for m in ckpt.list_checkpoints(save_dir).committed] == ["global_step1", "global_step3"]
    engine.destroy()
    comm.barrier()
    if rank == 0:
        shutil.rmtree(save_dir)


@pytest.mark.unit
def test_the_docs_say_what_max_failed_saves_does():
    """The test above: with max_failed_saves 2 the second failure in a row stops training. docs/config.md
    said two "may fail in a row" and "the next" (a third) stops it, against docs/reliability.md."""
    from pathlib import Path

    from zerodist.config.schema import CheckpointConfig

    docs = Path(__file__).resolve().parents[2] / "docs"
    described = CheckpointConfig.model_fields["max_failed_saves"].description or ""
    assert described.startswith("This many interval saves failing in a row stop training")
    assert described in (docs / "config.md").read_text()
    assert "`checkpoint.max_failed_saves` failures in a row stop training" in (docs / "reliability.md").read_text()
