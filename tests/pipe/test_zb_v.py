"""ZB-V and DualPipeV: two stages per rank in a V (rank r holds stages r and 2p - 1 - r).

Pure checks: the compute orders are torch.distributed.pipelining's (ScheduleZBVZeroBubble,
ScheduleDualPipeV), every built schedule passes `check_schedule`, and the simulator's idle time
is the formula of [Note: V schedules] in zerodist/pipe/schedule.py. End to end: `train_batch` on 2 gloo ranks equals
one process doing gradient accumulation (1e-6 fp32, 1e-12 fp64)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from tests.pipe.test_pipeline_engine import GAS, STEPS, check_against_reference, config, micro_batch, mlp_layers
from zerodist.pipe import PipelineModule
from zerodist.pipe.schedule import ScheduleArgumentError, build_schedule, stage_to_rank
from zerodist.pipe.schedule_checks import PlacementError, check_placement, check_schedule

V_CASES = [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (3, 7)]


def _build(name: str, p: int, m: int, **kw):
    return build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=2, **kw)


def _torch_compute(class_name: str, p: int, m: int) -> list[list[str]]:
    from unittest import mock

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    stages = []
    for _ in range(2):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, p, None
        stage.num_stages, stage.stage_index = 2 * p, 0
        stages.append(stage)
    order = getattr(schedules, class_name)(stages, m).pipeline_order
    result = []
    for rank in range(p):
        flat = []
        for action in order[rank]:
            if action is None:
                continue
            for sub in (action.sub_actions or (action,)) if action.computation_type.name == "OVERLAP_F_B" else (action,):
                if sub.computation_type.name in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"):
                    flat.append(str(sub))
        result.append(flat)
    return result


@pytest.mark.unit
@pytest.mark.parametrize("name,class_name", [("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7), (2, 5)])
def test_v_schedules_are_torchs(name, class_name, p, m):
    ours = [[str(a) for a in actions if a.kind.is_compute] for actions in _build(name, p, m, with_communication=False)]
    assert ours == _torch_compute(class_name, p, m)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", V_CASES)
def test_v_schedules_pass_every_check_and_place_stages_in_a_v(name, p, m):
    schedule = _build(name, p, m, with_sharding=True)
    check_schedule(schedule, num_microbatches=m, num_stages=2 * p)
    for rank, actions in enumerate(schedule):
        assert {a.stage for a in actions if a.kind.is_compute} == {rank, 2 * p - 1 - rank}
    assert [stage_to_rank(s, p, "v") for s in range(2 * p)] == list(range(p)) + list(reversed(range(p)))
    with pytest.raises(PlacementError, match="loop placement"):
        check_placement(schedule, 2 * p, "loop")


@pytest.mark.unit
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (3, 2), (4, 3), (1, 3)])
def test_zbv_with_fewer_micro_batches_than_the_v_is_deep_still_checks(p, m):
    # torch fills the order up to 2p - 1 micro-batches and drops the extra ones; so does zbv
    check_schedule(_build("zbv", p, m), num_microbatches=m, num_stages=2 * p)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", V_CASES)
def test_v_idle_share_is_the_formula(name, p, m):
    # At the zero-bubble paper's unit costs per chunk (F = I = W = 1, B = 2) every rank idles the
    # V's fill, p - 1 chunk forwards, and nothing else: share (p - 1) / (6m + p - 1).
    result = check_schedule(_build(name, p, m), num_microbatches=m, num_stages=2 * p)
    assert result.idle == (p - 1,) * p
    assert Fraction(result.idle_share).limit_denominator(10_000) == Fraction(p - 1, 6 * m + p - 1)


@pytest.mark.unit
def test_v_schedule_arguments_are_named():
    with pytest.raises(ScheduleArgumentError, match="exactly two stages per rank"):
        build_schedule("zbv", num_ranks=2, num_microbatches=4, stages_per_rank=1)
    with pytest.raises(ScheduleArgumentError, match="DualPipeV needs at least as many micro-batches"):
        build_schedule("dualpipev", num_ranks=2, num_microbatches=3, stages_per_rank=2)


def v_body(schedule: str, dtype_name: str, placement: str = "v", zero_stage: int = 1):
    dtype = getattr(torch, dtype_name)
    module = PipelineModule(mlp_layers(dtype), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", stages_per_rank=2, stage_placement=placement)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(zero_stage, schedule))
    losses, states = [], []
    for step in range(STEPS):
        loss = engine.train_batch(iter([micro_batch(step, micro, 0, dtype) for micro in range(GAS)]))
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in engine.module_state_dict().items()})
    peak = engine.last_run.peak_stashed
    engine.destroy()
    return losses, states, 0, peak


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_v_schedules_equal_gradient_accumulation(schedule, dtype):
    results = run_distributed(v_body, 2, schedule, dtype)
    check_against_reference(results, 1, dtype)


def test_v_schedule_under_zero3_equals_gradient_accumulation():
    # ZeRO-3 gathers each of a rank's two stages around its computes (UNSHARD / RESHARD actions)
    results = run_distributed(v_body, 2, "zbv", "float32", "v", 3)
    check_against_reference(results, 1, "float32")


def test_v_schedule_on_a_loop_module_is_a_named_error():
    from tests.harness import DistributedTestFailure

    with pytest.raises(DistributedTestFailure, match="stage_placement='v'"):
        run_distributed(v_body, 2, "zbv", "float32", "loop")


def v_eval_body(schedule: str):
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", stages_per_rank=2, stage_placement="v")
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1, schedule))
    batches = [micro_batch(0, micro, 0, torch.float32) for micro in range(GAS)]
    loss = engine.eval_batch(iter(batches)).item()
    engine.destroy()
    reference = torch.nn.Sequential(*mlp_layers())
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(reference(x), y).item() for x, y in batches) / GAS
    return loss, expected


@pytest.mark.parametrize("schedule", ["dualpipev"])
def test_v_schedule_eval_batch_is_one_process_forward(schedule):
    # the loss comes from rank 0 (the V's last stage) and reaches every rank
    results = run_distributed(v_eval_body, 2, schedule)
    for loss, expected in results:
        assert loss == pytest.approx(expected, rel=1e-6)


def checkpointed_body(schedule: str):
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", activation_checkpoint_interval=1)
    zerodist.initialize(model=module, config=config(1, schedule))


def test_split_schedule_with_reentrant_checkpointing_is_a_named_error():
    from tests.harness import DistributedTestFailure

    with pytest.raises(DistributedTestFailure, match="pipeline.use_reentrant: false"):
        run_distributed(checkpointed_body, 2, "zb")
