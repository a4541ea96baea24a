"""The unit runtime driven by hand, as a pipeline schedule will drive it ([Note: driving the
runtime] in zerodist/zero/runtime.py): every unit unsharded once, four forward/backward pairs with
the units kept gathered and gradients accumulated locally, one reduction at the end. The result
equals four-step gradient accumulation as stages 0/1 do it (local sums, one reduction) bitwise,
and the tracer counts one gather per unit bucket and one reduction per gradient bucket per batch."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import run_distributed
from zerodist.models import GPT, GPTConfig
from zerodist.zero import UnitState

SEQ, MICRO, GAS, STEPS = 16, 2, 4, 2


def engine_at(stage: int):
    """A 3-block GPT whose blocks are units; overlap off, so no gather runs between batches."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=SEQ, d_model=32, n_layers=3, n_heads=2))
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": False, "reduce_scatter": True,
                              "stage3_param_persistence_threshold": 100,
                              "reduce_bucket_size": 2500, "allgather_bucket_size": 2500},
    }
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    return engine


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + comm.get_rank())
    tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def accumulated_body(stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the default schedule's gradient accumulation."""
    engine = engine_at(stage)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            loss = engine(*micro_batch(step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    state = engine.module_state_dict()
    engine.destroy()
    return losses, state


def driven_body(stage: int, explicit: bool) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, int]]]:
    engine = engine_at(stage)
    runtime = engine.units
    sharded = engine.sharding.shard_parameters
    unit_gathers = sum(len(g.layout.buckets) for u in runtime.units for g in u.groups) if sharded else 0
    grad_buckets = len(engine.reducer.order)
    losses, counts = [], []
    for step in range(STEPS):
        with comm.trace() as trace, runtime.driven():
            runtime.unshard()  # every unit, once for the batch
            runtime.wait_unshard()
            for micro in range(GAS):
                loss = engine(*micro_batch(step, micro))
                engine.backward(loss)
                assert all(u.state is UnitState.UNSHARDED for u in runtime.units)  # kept gathered
                losses.append(loss.item())
                if micro < GAS - 1:
                    engine.step()  # not the boundary: counts the micro-step only
            assert trace.count("reduce_scatter") == 0  # nothing reduced yet
            gathers = trace.count("all_gather")  # the step's own (the updated persistent groups') aside
            if explicit:
                runtime.reduce_gradients()
                runtime.reshard()
                reductions = trace.count("reduce_scatter")
            else:  # the boundary step reduces what is still deferred and frees the units (the README's way)
                before = trace.count("reduce_scatter")
                engine.step()
                reductions = trace.count("reduce_scatter") - before
        counts.append({"gathers": gathers, "reductions": reductions,
                       "expected_gathers": unit_gathers + (1 if sharded else 0),  # + one order-check exchange
                       "expected_reductions": grad_buckets})
        if explicit:
            engine.step()  # the boundary
        assert all(u.state is (UnitState.SHARDED if sharded else UnitState.UNSHARDED) for u in runtime.units)
    state = engine.module_state_dict()
    engine.destroy()
    return losses, state, counts


@pytest.mark.parametrize("stage,explicit", [(3, True), (3, False), (2, True)])
def test_driven_runtime_equals_local_gradient_accumulation_bitwise(stage, explicit):
    reference = run_distributed(accumulated_body, 2, 1)  # stage 1: local sums, one reduction per step
    driven = run_distributed(driven_body, 2, stage, explicit)
    for (ref_losses, ref_state), (losses, state, counts) in zip(reference, driven):
        assert losses == ref_losses
        assert ref_state.keys() == state.keys()
        for key in ref_state:
            assert torch.equal(ref_state[key], state[key]), key
        for count in counts:
            assert count["gathers"] == count["expected_gathers"], count
            assert count["reductions"] == count["expected_reductions"], count


def default_stage3_body() -> list[int]:
    """The default schedule at stage 3 gathers units again every micro-batch: what driving saves."""
    engine = engine_at(3)
    with comm.trace() as trace:
        for micro in range(GAS - 1):
            engine.backward(engine(*micro_batch(0, micro)))
            engine.step()
    gathers = trace.count("all_gather")
    engine.destroy()
    return [gathers]


def test_default_schedule_gathers_every_micro_batch_for_contrast():
    (gathers,), _ = run_distributed(default_stage3_body, 2)
    per_batch = run_distributed(driven_body, 2, 3, True)[0][2][0]["gathers"]
    assert gathers > 2 * per_batch


def destroy_body() -> list[int]:
    """`destroy()` takes every hook zerodist put on the model off it, MoE's routing clock included."""
    from zerodist.models.moe_gpt import MoEGPT

    torch.manual_seed(0)
    model = MoEGPT(GPTConfig(seq_len=SEQ, d_model=32, n_layers=2, n_heads=2))
    before = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    engine, _, _, _ = zerodist.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}})
    engine.backward(engine(*micro_batch(0, 0)))
    engine.step()
    engine.destroy()
    after = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    return [sum(before), sum(after)]


def test_destroy_removes_every_module_hook():
    for before, after in run_distributed(destroy_body, 2):
        assert after == before
