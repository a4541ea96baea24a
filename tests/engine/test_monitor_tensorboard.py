"""DeepSpeed's tensorboard section: the events zerodist writes, read back with TensorBoard's own
reader (EventAccumulator), not a mock. Skipped where the tensorboard package is not installed."""

from __future__ import annotations

import tempfile

import pytest
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test
from zerodist.models import make_mlp

pytest.importorskip("tensorboard")


@distributed_test(world_size=2)
def test_tensorboard_events_read_back_with_deepspeeds_names():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    box = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    comm.broadcast_object_list(box, src=0)
    config = base_config(1, tensorboard={"enabled": True, "output_path": box[0], "job_name": "job"})
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
    if rank == 0:
        events = EventAccumulator(f"{box[0]}/job").Reload()
        # DeepSpeed's names; loss_scale only under fp16, as DeepSpeed writes it
        assert set(events.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr"}
        written = events.Scalars("Train/Samples/train_loss")
        assert [e.step for e in written] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [e.value for e in written] == pytest.approx(losses, rel=1e-6)
        assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([lr] * 3)
