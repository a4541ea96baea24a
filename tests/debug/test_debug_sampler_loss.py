"""Sampler safety (a forgotten set_epoch is a named warning) and the engine's logged loss (the
mean over ranks, not rank 0's, for one scalar all_reduce on print steps only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import zerodist
import zerodist.comm as comm
from zerodist.debug import RepeatedEpochError, SamplerWatch, reduce_loss
from zerodist.models import make_mlp
from tests.debug_helpers import captured_logs
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

DATA = TensorDataset(torch.arange(64.0))


def _epochs(loader, num_epochs: int, set_epoch: bool) -> list[list[float]]:
    orders = []
    for epoch in range(num_epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)  # passed through the watch to the DistributedSampler
        orders.append([x.item() for (batch,) in loader for x in batch])
    return orders


@pytest.mark.unit
def test_forgotten_set_epoch_warns_naming_the_epoch_and_the_fix():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = DataLoader(DATA, batch_size=4, sampler=SamplerWatch(sampler))
    with captured_logs() as logs:
        orders = _epochs(loader, 3, set_epoch=False)
    assert orders[0] == orders[1] == orders[2]
    assert loader.sampler.repeated_epochs == [1, 2]
    assert logs[0] == ("epoch 1 starts with the same sample order as epoch 0: DistributedSampler.epoch is still 0: "
                       "call sampler.set_epoch(epoch) before each epoch (the engine's own loader, from "
                       "initialize(training_data=...), does this for you)")
    assert "__dict__" not in vars(sampler) and sorted(vars(sampler)) == sorted(
        vars(DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=3)))  # nothing set on it


@pytest.mark.unit
def test_set_epoch_called_or_no_shuffle_stays_quiet():
    watched = DataLoader(DATA, batch_size=4, sampler=SamplerWatch(
        DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True)))
    plain = DataLoader(DATA, batch_size=4, sampler=SamplerWatch(
        DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=False)))
    sequential = DataLoader(DATA, batch_size=4, sampler=SamplerWatch(SequentialSampler(DATA)))
    with captured_logs() as logs:
        orders = _epochs(watched, 3, set_epoch=True)
        _epochs(plain, 2, set_epoch=False)
        _epochs(sequential, 2, set_epoch=False)
    assert orders[0] != orders[1] and logs == []


@pytest.mark.unit
def test_wrapping_the_loader_reads_the_epoch_and_strict_raises():
    loader = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, num_replicas=2, rank=0))
    watch = SamplerWatch(loader, strict=True)
    assert len(watch) == len(loader) == 4
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        assert sum(1 for _ in watch) == 4
    with pytest.raises(RepeatedEpochError, match="epoch 2 starts with the same sample order as epoch 1"):
        iter(watch)


@distributed_test(world_size=2)
def test_engine_logs_the_loss_averaged_over_ranks_and_micro_steps():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(
        0, steps_per_print=2, gradient_accumulation_steps=2))
    rank, losses, traces = comm.get_rank(), [], []
    try:
        with captured_logs("zerodist.engine") as logs:
            for step in range(2):
                x, y = global_batch(step, 16)
                with comm.trace() as t:
                    for micro in range(2):
                        rows = slice(8 * micro + 4 * rank, 8 * micro + 4 * rank + 4)
                        loss = F.mse_loss(engine(x[rows]), y[rows]) * (1 + rank)  # ranks differ on purpose
                        engine.backward(loss)
                        engine.step()
                        losses.append(loss.detach())
                traces.append(t)
        expected = reduce_loss(torch.stack(losses[2:]).mean()).item()
        # the print step (2) costs exactly one more all_reduce than the quiet step (1)
        assert traces[1].count("all_reduce") == traces[0].count("all_reduce") + 1
        line = [m for m in logs if m.startswith("step 2: loss")]
        if rank == 0:
            logged = float(line[0].split()[3])
            assert logged == pytest.approx(expected, rel=1e-5)
            assert logged != pytest.approx(torch.stack(losses[2:]).mean().item(), rel=1e-3)  # not rank 0's own
            return line[0]
        assert line == []
    finally:
        engine.destroy()
