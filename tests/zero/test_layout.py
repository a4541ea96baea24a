"""Layout arithmetic (pure: no tensors' values, no processes), the sharding policy, and the
bucket and unit lifecycles refusing illegal transitions."""

from __future__ import annotations

import pytest
import torch

from tests.harness import distributed_test
from zerodist.zero.bucket import Bucket, BucketState, GradSyncPlan
from zerodist.zero.layout import ALIGN, OwnedSlice, padded_numel, plan_layout
from zerodist.zero.policy import ShardingPolicy
from zerodist.zero.units import Unit, UnitState


@pytest.mark.unit
def test_padding_is_a_multiple_of_world_size_times_align_and_never_empty():
    assert padded_numel(0, 1) == ALIGN
    assert padded_numel(1, 4) == 4 * ALIGN
    assert padded_numel(4 * ALIGN, 4) == 4 * ALIGN
    assert padded_numel(4 * ALIGN + 1, 4) == 8 * ALIGN
    assert padded_numel(10, 3, align=2) == 12


@pytest.mark.unit
def test_plan_layout_packs_whole_parameters_into_buckets_in_order():
    layout = plan_layout([100, 50, 300, 10], bucket_numel=160, world_size=2, align=8)
    # 100 + 50 fit; 300 is larger than a bucket: alone; 10 starts a new bucket
    assert [b.param_indices for b in layout.buckets] == [(0, 1), (2,), (3,)]
    assert [(s.offset, s.numel, s.bucket) for s in layout.slots] == [(0, 100, 0), (100, 50, 0), (160, 300, 1),
                                                                      (464, 10, 2)]
    assert [(b.offset, b.numel, b.shard_numel) for b in layout.buckets] == [(0, 160, 80), (160, 304, 152),
                                                                             (464, 16, 8)]
    assert layout.total_numel == 480 and layout.shard_numel == 240
    assert layout.padding == 480 - 460
    with pytest.raises(ValueError, match="world_size"):
        plan_layout([1], bucket_numel=1, world_size=0)


@pytest.mark.unit
def test_owned_slices_tile_every_parameter_exactly_once_over_the_ranks():
    numels = [7, 130, 1, 64, 250]
    for world_size in (1, 2, 3, 4):
        layout = plan_layout(numels, bucket_numel=200, world_size=world_size, align=4)
        covered = [[0] * n for n in numels]
        for rank in range(world_size):
            shard_cursor = 0
            for piece in layout.owned_slices(rank):
                assert piece.shard_start >= shard_cursor  # in shard order, disjoint
                shard_cursor = piece.shard_start + piece.length
                for i in range(piece.param_start, piece.param_start + piece.length):
                    covered[piece.param_index][i] += 1
            assert shard_cursor <= layout.shard_numel
        assert all(c == 1 for row in covered for c in row), world_size


@pytest.mark.unit
def test_owned_slices_of_a_parameter_split_between_two_ranks():
    layout = plan_layout([10, 6], bucket_numel=100, world_size=2, align=4)  # one bucket of 16: 8 per rank
    assert layout.owned_slices(0) == [OwnedSlice(0, 0, 8, 0)]
    assert layout.owned_slices(1) == [OwnedSlice(0, 8, 2, 0), OwnedSlice(1, 0, 6, 2)]


@pytest.mark.unit
def test_the_policy_of_each_stage_and_its_persistent_groups():
    policies = [ShardingPolicy.from_stage(s) for s in range(4)]
    assert [(p.shard_optimizer_state, p.shard_gradients, p.shard_parameters) for p in policies] == [
        (False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    assert [p.stage for p in policies] == [0, 1, 2, 3]
    assert policies[3].for_persistent() == policies[2]  # persistent: parameters full, the rest sharded
    assert policies[1].for_persistent() == policies[1]
    with pytest.raises(ValueError, match="sharded parameters need sharded gradients"):
        ShardingPolicy(True, False, True)
    with pytest.raises(ValueError, match="sharded gradients need sharded optimizer state"):
        ShardingPolicy(False, True, False)
    with pytest.raises(ValueError, match="stage must be"):
        ShardingPolicy.from_stage(4)
    with pytest.raises(Exception):
        policies[0].shard_gradients = True  # frozen


def _bucket(num_params: int = 2) -> Bucket:
    layout = plan_layout([3] * num_params, bucket_numel=100, world_size=1, align=4)
    full = torch.zeros(layout.total_numel)
    return Bucket(layout.buckets[0], plan=GradSyncPlan(False, persistent_full_grad=True, divisor=1), grad_full=full,
                  grad_owned=full, group=None, rank=0, label="test bucket", slots=layout.slots)


@pytest.mark.unit
def test_bucket_refuses_transitions_out_of_order_without_a_collective():
    bucket = _bucket()
    with pytest.raises(AssertionError, match="finish_grad_sync while filling"):
        bucket.finish_grad_sync()
    assert not bucket.register_grad_ready() and bucket.register_grad_ready()
    with pytest.raises(AssertionError, match="3 gradients for 2 parameters"):
        bucket.register_grad_ready()


@distributed_test(world_size=1)
def test_bucket_lifecycle_with_a_real_collective():
    bucket = _bucket()
    bucket.register_grad_ready()
    bucket.start_grad_sync()
    assert bucket.state is BucketState.SYNCING
    with pytest.raises(AssertionError, match="gradient arrived while syncing"):
        bucket.register_grad_ready()
    with pytest.raises(AssertionError, match="start_grad_sync while syncing"):
        bucket.start_grad_sync()
    with pytest.raises(AssertionError, match="reset with a collective still in flight"):
        bucket.reset()
    bucket.finish_grad_sync()
    with pytest.raises(AssertionError, match="finish_grad_sync while synced"):
        bucket.finish_grad_sync()
    bucket.reset()
    assert bucket.state is BucketState.FILLING and bucket.num_ready == 0


@pytest.mark.unit
def test_unit_refuses_transitions_out_of_order():
    unit = Unit(1, "block", torch.nn.Linear(2, 2), [])
    with pytest.raises(AssertionError, match="finish_unshard while sharded"):
        unit.finish_unshard()
    unit.start_unshard()
    with pytest.raises(AssertionError, match="start_unshard while gathering"):
        unit.start_unshard()
    unit.finish_unshard()
    assert unit.state is UnitState.UNSHARDED
    with pytest.raises(AssertionError, match="start_unshard while unsharded"):
        unit.start_unshard()
    unit.reshard()
    assert unit.state is UnitState.SHARDED


@pytest.mark.unit
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_slice_runs_map_a_slice_onto_its_logical_tensor(dim, num_parts):
    from zerodist.zero.layout import slice_runs

    logical_shape = [6, 5, 6]
    logical_shape[dim] = 6  # divisible by every number of parts
    logical = torch.arange(torch.Size(logical_shape).numel()).reshape(logical_shape)
    flat = logical.reshape(-1)
    for part, piece in enumerate(torch.chunk(logical, num_parts, dim=dim)):
        local = piece.contiguous().reshape(-1)
        for start, length in [(0, local.numel()), (1, 5), (7, 13), (local.numel() - 2, 2), (3, 0)]:
            runs = slice_runs(start, length, shape=piece.shape, dim=dim, part=part, num_parts=num_parts)
            assert sum(r[1] for r in runs) == length
            for logical_start, run, offset in runs:
                assert torch.equal(flat[logical_start: logical_start + run], local[start + offset: start + offset + run])
