"""Gradient and weight sync checks: clean runs pass, a fault injected on one rank is named
with that rank and parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist.comm as comm
from zerodist.debug import (GradientSyncError, GradSyncWatch, WeightSyncError, check_gradient_sync,
                            check_weight_sync)
from zerodist.models import make_mlp
from tests.debug_helpers import gpt_engine, train_step
from tests.harness import distributed_test

TARGET = "blocks.1.mlp.fc_in.weight"


def _slot(engine, name):
    for group in engine.groups:
        for record in group.records:
            if record.name == name:
                return group, record.slot
    raise KeyError(name)


def _inject_owned(engine, name: str, delta: float) -> bool:
    """Add `delta` to the first element of `name` that this rank owns in its reduced shard."""
    group, slot = _slot(engine, name)
    for bucket in group.buckets:
        lo = bucket.span.shard_offset(group.rank)
        start = max(lo, slot.offset)
        if start < min(lo + bucket.span.shard_numel, slot.offset + slot.numel):
            bucket.grad_owned[start - lo] += delta
            return True
    return False


def _owned_by(engine, name: str, rank: int) -> bool:
    group, slot = _slot(engine, name)
    return any(s.param_index == group.layout.slots.index(slot) for s in group.layout.owned_slices(rank))


@distributed_test(world_size=[2, 4])
def test_stage0_gradient_difference_on_one_rank_is_named(world_size):
    engine = gpt_engine(0)
    try:
        train_step(engine, 0)
        train_step(engine, 1, optimizer_step=False)
        clean = check_gradient_sync(engine, raise_on_mismatch=True)
        assert clean.ok and len(clean.params) == len(list(engine.module.parameters()))
        bad_rank = world_size - 1
        if comm.get_rank() == bad_rank:
            group, slot = _slot(engine, TARGET)
            group.grad_buffer[slot.offset + 5] += 0.5  # after reduction: this replica drifted
        with pytest.raises(GradientSyncError) as caught:
            check_gradient_sync(engine, raise_on_mismatch=True)
        report = caught.value.report
        assert [p.name for p in report.mismatched] == [TARGET]
        bad = report.mismatched[0]
        assert bad.differing_ranks == (bad_rank,) and bad.max_abs_diff == pytest.approx(0.5)
        others = ", ".join(str(r) for r in range(world_size) if r != bad_rank)
        reference = f"rank {others}" if world_size == 2 else f"ranks {others}"
        message = str(caught.value)
        assert f"{TARGET}: rank {bad_rank} differs from {reference} (max abs diff 5.0000e-01)" in message
        assert f"rank {bad_rank} {bad.rank_norms[bad_rank]:.4e}" in message and "bitwise" in message
        return message
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(world_size=2)
def test_sharded_gradients_checked_against_a_reference_reduction(stage):
    engine = gpt_engine(stage, gradient_accumulation_steps=2)
    watch = GradSyncWatch(engine)
    try:
        with pytest.raises(ValueError, match=f"stage {stage} each rank holds only its own shard.*GradSyncWatch"):
            check_gradient_sync(engine)
        for step in range(2):  # two optimizer steps of two micro-steps: the watch restarts after each
            train_step(engine, 2 * step)
            train_step(engine, 2 * step + 1, optimizer_step=False)
            report = watch.check(raise_on_mismatch=True)
            assert report.ok and "reference all_reduce" in report.method
            engine.step()
        train_step(engine, 4)
        train_step(engine, 5, optimizer_step=False)
        name = next(n for n in (r.name for r in engine.groups[0].records) if _owned_by(engine, n, 1) and n.startswith("blocks.1"))
        if comm.get_rank() == 1:  # after the reduction: rank 1's shard of `name` drifted
            assert _inject_owned(engine, name, 0.25)
        with pytest.raises(GradientSyncError) as caught:
            watch.check(raise_on_mismatch=True)
        bad = caught.value.report.mismatched
        assert [p.name for p in bad] == [name] and bad[0].differing_ranks == (1,)
        assert bad[0].max_abs_diff == pytest.approx(0.25, rel=1e-3)
        assert f"{name}: rank 1 differs from the reference reduction" in str(caught.value)
        return str(caught.value)
    finally:
        watch.close()
        engine.destroy()


@distributed_test(world_size=2)
def test_plain_model_grads_compared_like_ddp():
    model = make_mlp()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(comm.get_rank()))
    F.mse_loss(model(x), torch.zeros(4, 8)).backward()
    unsynced = check_gradient_sync(model)  # nobody averaged: every gradient differs
    assert len(unsynced.mismatched) == 6
    for param in model.parameters():
        comm.all_reduce(param.grad, op=comm.ReduceOp.AVG)
    assert check_gradient_sync(model).ok
    if comm.get_rank() == 1:
        model[2].bias.grad[0] *= 1.5
    report = check_gradient_sync(model)
    assert [(p.name, p.differing_ranks) for p in report.mismatched] == [("2.bias", (1,))]
    # print(report) reads like the error would: the formatted report, not a dataclass dump
    assert str(report) == report.format()
    assert str(report).startswith("gradients differ across the 2 data-parallel ranks for 1 of 6")
    assert "2.bias: rank 1 differs from rank 0" in str(report) and "ParamSync(" not in str(report)


@distributed_test(world_size=2)
def test_parameter_nudged_on_one_rank_is_named():
    engine = gpt_engine(1)
    try:
        for step in range(2):
            train_step(engine, step)
        assert check_weight_sync(engine, raise_on_mismatch=True).ok
        if comm.get_rank() == 1:
            with torch.no_grad():
                engine.module.blocks[0].attn.qkv.weight[3, 4] += 1e-3
        with pytest.raises(WeightSyncError) as caught:
            check_weight_sync(engine, raise_on_mismatch=True)
        bad = caught.value.report.mismatched
        assert [(p.name, p.differing_ranks) for p in bad] == [("blocks.0.attn.qkv.weight", (1,))]
        assert bad[0].max_abs_diff == pytest.approx(1e-3, rel=1e-3)
        assert "blocks.0.attn.qkv.weight: rank 1 differs from rank 0" in str(caught.value)
        return str(caught.value)
    finally:
        engine.destroy()


@pytest.mark.unit
def test_checksum_sees_order_and_single_bits():
    from zerodist.debug.sync import checksum

    a = torch.tensor([1.0, 2.0, 3.0])
    assert checksum(a) == checksum(a.clone())
    assert checksum(a) != checksum(torch.tensor([2.0, 1.0, 3.0]))  # a permutation (wrong bucket order)
    b = a.clone()
    b.view(torch.int32)[1] ^= 1  # one flipped low bit
    assert checksum(a) != checksum(b)
    assert checksum(a.bfloat16()) != checksum(a)
