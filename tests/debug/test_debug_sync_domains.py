"""check_gradient_sync on an engine whose parameters live in two sharding domains (dense and
expert, 2 data x 2 expert ranks): each domain's reduced gradient is compared over the ranks it
is reduced over, and a fault on one rank is named with that rank and parameter."""

from __future__ import annotations

import math

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.debug import (GradientSyncError, GradSyncWatch, WeightSyncError, check_gradient_sync,
                            check_weight_sync)
from tests.engine_helpers import base_config
from tests.harness import distributed_test
from tests.debug.test_debug_sync import _inject_owned, _owned_by, _slot
from tests.moe.test_moe_engine import MoEModel, _batch

pytestmark = pytest.mark.multiprocess

DENSE = "inp.weight"


def _expert(rank: int) -> str:
    """The first expert weight that `rank` holds: experts are named by global index, 2 per expert rank."""
    return f"moe.deepspeed_moe.experts.deepspeed_experts.{2 * (rank % 2)}.0.weight"


def _moe_engine(stage: int):
    model = MoEModel(2, comm.get_rank() % 2, k=1, drop_tokens=False)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage))
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2, "expert": 2, "sequence": 1, "tensor": 1}
    return engine


def _backward(engine, step: int) -> None:
    engine.backward(engine(*_batch(step, engine.topology.batch_rank)))


def _partners(rank: int, name: str) -> tuple[int, ...]:
    """The ranks over which `name` (held by `rank`)'s gradient is reduced: all 4 for a dense
    parameter; for an expert, the two ranks holding the same experts (expert rank = rank % 2)."""
    return (0, 1, 2, 3) if name == DENSE else tuple(r for r in range(4) if r % 2 == rank % 2)


@distributed_test(world_size=4)
def test_stage0_each_domain_compared_over_its_own_ranks_and_every_rank_raises():
    engine = _moe_engine(0)
    rank = comm.get_rank()
    try:
        _backward(engine, 0)
        clean = check_gradient_sync(engine, raise_on_mismatch=True)
        assert clean.ok and clean.ranks == (0, 1, 2, 3) and "each sharding domain" in clean.method
        assert len(clean.params) == len(list(engine.module.parameters()))
        expert = next(p for p in clean.params if p.name == _expert(rank))
        # nan for the ranks holding the other experts: they are not compared with this one
        assert [math.isnan(n) for n in expert.rank_norms] == [r % 2 != rank % 2 for r in range(4)]
        messages = []
        for name, bad_rank in ((_expert(3), 3), (DENSE, 2)):
            if rank == bad_rank:
                group, slot = _slot(engine, name)
                saved = group.grad_buffer[slot.offset + 1].clone()
                group.grad_buffer[slot.offset + 1] += 0.5  # after the reduction: this replica drifted
            with pytest.raises(GradientSyncError) as caught:  # on every rank, not only the bad one's group
                check_gradient_sync(engine, raise_on_mismatch=True)
            if rank == bad_rank:
                group.grad_buffer[slot.offset + 1] = saved  # bitwise as before
            [bad] = caught.value.report.mismatched
            partners = _partners(bad_rank, name)
            # the ranks outside the bad rank's group are told which group it was
            shown = name if rank in partners else f"{name} (on ranks {', '.join(map(str, partners))})"
            assert (bad.name, bad.differing_ranks) == (shown, (bad_rank,))
            assert bad.max_abs_diff == pytest.approx(0.5)
            messages.append(str(caught.value))
        assert check_gradient_sync(engine).ok
        return messages
    finally:
        engine.destroy()


@distributed_test(world_size=4)
def test_stage2_experts_against_the_reference_reduction():
    engine = _moe_engine(2)
    watch = GradSyncWatch(engine)
    rank = comm.get_rank()
    try:
        _backward(engine, 0)
        clean = watch.check(raise_on_mismatch=True)
        assert clean.ok and "reference all_reduce" in clean.method and "each sharding domain" in clean.method
        bad_rank = 3  # rank 1 of the expert group (1, 3)
        mine = next(n for n in (r.name for g in engine.groups for r in g.records)
                    if "experts" in n and _owned_by(engine, n, 1))
        names = [None] * 4
        comm.all_gather_object(names, mine)
        name = names[bad_rank]
        if rank == bad_rank:
            assert _inject_owned(engine, name, 0.25)
        with pytest.raises(GradientSyncError) as caught:
            watch.check(raise_on_mismatch=True)
        [bad] = caught.value.report.mismatched
        shown = name if rank % 2 == 1 else f"{name} (on ranks 1, 3)"
        assert (bad.name, bad.differing_ranks) == (shown, (bad_rank,))
        assert bad.max_abs_diff == pytest.approx(0.25, rel=1e-3)
        assert f"{shown}: rank 3 differs from the reference reduction" in str(caught.value)
        return str(caught.value)
    finally:
        watch.close()
        engine.destroy()


@distributed_test(world_size=4, timeout=240)
def test_a_tensor_parallel_slice_that_drifted_on_one_rank_raises_on_every_rank():
    """data=2 x tensor=2: a column slice is compared over the data ranks holding the same slice
    only, yet every rank raises (the others would otherwise wait alone at their next collective)."""
    from tests.tensor_parallel.test_tp_engine import _config, _train
    from zerodist.comm.topology import coords_of

    engine = _train(_config(0, tensor=2), 1)
    try:
        name = "blocks.0.mlp.fc_in.weight"
        assert check_weight_sync(engine, raise_on_mismatch=True).ok
        bad_rank = 3
        if comm.get_rank() == bad_rank:
            with torch.no_grad():
                dict(engine.module.named_parameters())[name][0, 0] += 1e-3
        with pytest.raises(WeightSyncError) as caught:
            check_weight_sync(engine, raise_on_mismatch=True)
        [bad] = caught.value.report.mismatched
        # the slice is compared over the ranks holding the same one: the bad rank's tensor coordinate
        tensor = [coords_of(r, engine.topology.degrees)["tensor"] for r in range(4)]
        holders = tuple(r for r in range(4) if tensor[r] == tensor[bad_rank])
        shown = name if comm.get_rank() in holders else f"{name} (on ranks {', '.join(map(str, holders))})"
        assert (bad.name, bad.differing_ranks) == (shown, (bad_rank,))
        return str(caught.value)
    finally:
        engine.destroy()
