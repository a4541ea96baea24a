"""DeepSpeed's csv_monitor and tensorboard sections are honoured, not ignored."""

from __future__ import annotations

import csv
import os
import tempfile

import pytest
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.engine.monitor import TensorboardMonitor
from zerodist.models import make_mlp
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test


def _train_three_steps(section: str) -> tuple[str | None, list[float], float]:
    """Three steps with the monitor `section` writing under a folder of rank 0's; returns (the
    folder on rank 0, each step's loss averaged over the ranks, the last learning rate)."""
    box = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    comm.broadcast_object_list(box, src=0)
    config = base_config(1, **{section: {"enabled": True, "output_path": box[0], "job_name": "job"}})
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config)
    rank, losses = comm.get_rank(), []
    for step in range(3):
        x, y = global_batch(step, 8)
        loss = F.mse_loss(engine(x[rank * 4: rank * 4 + 4]), y[rank * 4: rank * 4 + 4])
        mean = loss.detach().clone()
        comm.all_reduce(mean, op=comm.ReduceOp.AVG)
        losses.append(mean.item())
        engine.backward(loss)
        engine.step()
    lr = engine.get_lr()[0]
    engine.destroy()
    return box[0], losses, lr


@distributed_test(world_size=2)
def test_csv_monitor_writes_the_mean_loss_per_step():
    folder, losses, _ = _train_three_steps("csv_monitor")
    if comm.get_rank() == 0:
        assert folder is not None
        with open(os.path.join(folder, "job", "Train_Samples_train_loss.csv")) as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", "Train/Samples/train_loss"]
        assert [int(r[0]) for r in rows[1:]] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
        assert os.path.exists(os.path.join(folder, "job", "Train_Samples_lr.csv"))


@distributed_test(world_size=2)
def test_tensorboard_events_read_back_with_deepspeeds_names():
    # TensorBoard's own reader, not a mock (tensorboard is in the test extra)
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    folder, losses, lr = _train_three_steps("tensorboard")
    if comm.get_rank() == 0:
        events = accumulator.EventAccumulator(f"{folder}/job").Reload()
        # DeepSpeed's names; loss_scale only under fp16, as DeepSpeed writes it
        assert set(events.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr"}
        written = events.Scalars("Train/Samples/train_loss")
        assert [e.step for e in written] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [e.value for e in written] == pytest.approx(losses, rel=1e-6)
        assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([lr] * 3)


@pytest.mark.unit
def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(zerodist.ConfigError, match="needs the tensorboard package: pip install tensorboard"):
        TensorboardMonitor("out", "job")
