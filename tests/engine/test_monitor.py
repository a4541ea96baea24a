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


@distributed_test(world_size=2)
def test_csv_monitor_writes_the_mean_loss_per_step():
    box = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    comm.broadcast_object_list(box, src=0)
    config = base_config(1, csv_monitor={"enabled": True, "output_path": box[0], "job_name": "job"})
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
    engine.destroy()
    if rank == 0:
        with open(os.path.join(box[0], "job", "Train_Samples_train_loss.csv")) as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", "Train/Samples/train_loss"]
        assert [int(r[0]) for r in rows[1:]] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
        assert os.path.exists(os.path.join(box[0], "job", "Train_Samples_lr.csv"))


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
