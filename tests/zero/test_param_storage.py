"""A flat group's parts (zerodist/zero/flat_group.py): the parameter storage's `ParamState`
lifecycle for both gather mechanisms, its guarded transitions, and the settings read once from
the config (`ZeroSettings.from_config`)."""

from __future__ import annotations

import pytest
import torch

import zerodist.comm as comm
from zerodist.config import Config
from zerodist.comm.topology import DENSE
from zerodist.zero import ZeroSettings
from zerodist.zero.flat_group import FlatParamGroup, ParamState
from zerodist.zero.param_storage import FullParams, ShardedParams
from zerodist.zero.policy import DomainGroup, ShardingPolicy
from tests.harness import distributed_test


def _group(stage: int, dtype: torch.dtype = torch.float32) -> tuple[FlatParamGroup, list[torch.nn.Parameter]]:
    torch.manual_seed(0)  # every rank builds the same values
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    domain_group = DomainGroup.of(comm.Topology(), DENSE)
    group = FlatParamGroup(list(params), ["a", "b"], policy=ShardingPolicy.from_stage(stage),
                           domain_group=domain_group, bucket_numel=16, use_reduce_scatter=stage >= 1,
                           param_dtype=dtype)
    return group, params


@pytest.mark.multiprocess
@distributed_test(world_size=2)
def test_sharded_lifecycle_and_guards():
    group, params = _group(3)
    expected = [p.detach().clone() for p in _group(0)[1]]  # the full values, from a stage-0 build
    assert isinstance(group.storage, ShardedParams) and group.state is ParamState.SHARDED
    assert torch.isnan(params[0]).all() and group.param_buffer is None and not group.is_unsharded
    group.start_unshard()
    assert group.state is ParamState.UNSHARDING and not group.is_unsharded
    with pytest.raises(AssertionError, match=r"reshard with a gather in flight.*2 parameters, 2 buckets.*"
                                             r"state unsharding, 2 all-gathers in flight, full buffer held"):
        group.reshard()
    with pytest.raises(AssertionError, match=r"start_unshard on b\.\.\. \(2 parameters, 2 buckets\): state unsharding"):
        group.start_unshard()
    group.wait_unshard()
    assert group.state is ParamState.GATHERED and group.is_unsharded and torch.isnan(params[0]).all()
    group.finish_unshard()
    assert group.state is ParamState.UNSHARDED
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    group.reshard()
    assert group.state is ParamState.SHARDED and group.param_buffer is None and torch.isnan(params[1]).all()
    with pytest.raises(AssertionError, match="finish_unshard on b.* state sharded, 0 all-gathers in flight, "
                                             "full buffer freed"):
        group.finish_unshard()
    group.unshard()  # again, the shard unchanged: the same values
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    group.reshard()
    assert group.state_bytes() == {"params": 4 * group.layout.shard_numel, "grads": 4 * group.layout.shard_numel,
                                   "master": 0}


@pytest.mark.multiprocess
@distributed_test(world_size=2)
def test_full_parameters_gather_in_place():
    for stage in (0, 1):
        group, params = _group(stage, torch.bfloat16)
        assert isinstance(group.storage, FullParams) and group.state is ParamState.UNSHARDED
        assert params[0].dtype == torch.bfloat16 and group.master is not None and group.master.dtype == torch.float32
        # This rank's stepped values change; the gather brings every rank's to every rank.
        for index, tensor in enumerate(group.optimizer_tensors):
            group.owned_part(index, tensor).fill_(comm.get_rank() + 1.0)
        group.copy_master_to_params()
        group.start_unshard()
        assert group.state is (ParamState.UNSHARDING if stage == 1 else ParamState.UNSHARDED)
        assert group.is_gathering_params == (stage == 1)
        if stage == 1:
            with pytest.raises(AssertionError, match="a gather is already pending"):
                group.start_unshard()
        group.wait_unshard()
        assert group.state is ParamState.UNSHARDED and group.is_unsharded and not group.is_gathering_params
        buffer = group.param_buffer
        assert buffer is not None
        for index, span in enumerate(group.layout.buckets):
            # stage 1: every rank's shard, gathered; stage 0: no gather (every rank steps the whole bucket)
            for rank in range(2) if stage == 1 else [comm.get_rank()]:
                piece = buffer[span.shard_offset(rank): span.shard_offset(rank) + span.shard_numel]
                assert bool((piece == rank + 1.0).all()), (stage, index, rank)
        group.reshard()  # nothing to free
        assert group.state is ParamState.UNSHARDED and group.param_buffer is buffer


@pytest.mark.unit
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_settings_read_once(stage):
    config = Config.load({"train_batch_size": 2, "zero_optimization": {
        "stage": stage, "reduce_scatter": True, "overlap_comm": False, "stage3_prefetch_bucket_size": 123}})
    settings = ZeroSettings.from_config(config)
    assert settings.sharding == ShardingPolicy.from_stage(stage)
    # reduce_scatter is a ZeRO 1-3 setting: stage 0 all-reduces, as DDP, whatever the config says
    assert settings.use_reduce_scatter == (stage >= 1)
    assert settings.units.prefetch_numel == 123 and settings.units.overlap is False and settings.overlap is False
