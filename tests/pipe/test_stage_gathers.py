"""Gather, free and reduce as schedule actions ([Note: sharding actions] in zerodist/pipe/schedule.py,
[Note: pipeline under ZeRO] in zerodist/engine/pipeline.py).

Pure: every built schedule with its UNSHARD / RESHARD / REDUCE_GRAD passes `check_sharding`, and a
misplaced one is a named `ShardingError`. On gloo ranks at ZeRO-3 with interleaved virtual stages:
the peak of gathered parameter bytes the unit runtime measured on each rank is exactly what the
schedule's actions predict (`peak_gathered`) for the stages' bytes: with every stage in flight the
rank's whole share, and with `max_active_stages: 1` one stage's, less than the share; the
parameters still equal one process's gradient accumulation within 1e-6."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from zerodist.engine.pipeline import StageGathers
from tests.pipe.test_pipeline_engine import GAS, STEPS, check_against_reference, config, micro_batch, mlp_layers
from zerodist.pipe import (Action, Kind, PipelineModule, ShardingError, add_sharding, build_schedule, check_schedule,
                           check_sharding, peak_gathered)

@pytest.mark.unit
@pytest.mark.parametrize("name, ranks, micro, per_rank", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("zb", 4, 8, 1),
                                                          ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)])
@pytest.mark.parametrize("window", [None, 1, 2])
def test_every_schedule_gathers_before_use_and_reduces_once(name, ranks, micro, per_rank, window):
    schedule = build_schedule(name, num_ranks=ranks, num_microbatches=micro, stages_per_rank=per_rank,
                              with_sharding=True, max_active_stages=window)
    plain = build_schedule(name, num_ranks=ranks, num_microbatches=micro, stages_per_rank=per_rank)
    # the same run: sharding actions take no time and carry no message
    assert check_schedule(schedule, num_microbatches=micro).idle_share == check_schedule(
        plain, num_microbatches=micro).idle_share
    for rank, actions in enumerate(schedule):
        assert [a for a in actions if not a.kind.is_sharding] == plain[rank]
        reduces = [a.stage for a in actions if a.kind is Kind.REDUCE_GRAD]
        assert sorted(reduces) == sorted({a.stage for a in plain[rank]})  # once per stage
    one_byte = {stage: 1 for stage in range(ranks * per_rank)}
    expected = per_rank if window is None else min(window, per_rank)
    assert peak_gathered(schedule, one_byte) == (expected,) * ranks


@pytest.mark.unit
def test_every_stage_is_gathered_once_per_batch_without_a_window():
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=4, stages_per_rank=2, with_sharding=True)
    for actions in schedule:
        unshards = [a.stage for a in actions if a.kind is Kind.UNSHARD]
        assert sorted(unshards) == sorted(set(unshards)) and len(unshards) == 2


@pytest.mark.unit
def test_misplaced_sharding_actions_are_named():
    good = build_schedule("1f1b", num_ranks=2, num_microbatches=2, with_sharding=True)
    check_sharding(good)
    gather = [a for a in good[0] if a.kind is not Kind.UNSHARD]
    with pytest.raises(ShardingError, match="not gathered"):
        check_sharding([gather, good[1]])
    no_reduce = [a for a in good[0] if a.kind is not Kind.REDUCE_GRAD]
    with pytest.raises(ShardingError, match="no REDUCE_GRAD"):
        check_sharding([no_reduce, good[1]])
    left = [a for a in good[0] if a.kind is not Kind.RESHARD]
    with pytest.raises(ShardingError, match="still gathered"):
        check_sharding([left, good[1]])
    early = [Action(Kind.REDUCE_GRAD, 0, -1)] + [a for a in no_reduce]
    with pytest.raises(ShardingError, match="before its last weight gradient"):
        check_sharding([early, good[1]])
    # a forward-only schedule has no REDUCE_GRAD at all
    evaluation = add_sharding([[a for a in actions if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)]
                               for actions in build_schedule("1f1b", num_ranks=2, num_microbatches=2)])
    check_sharding(evaluation)
    assert not any(a.kind is Kind.REDUCE_GRAD for actions in evaluation for a in actions)


def gathered_body(window: int | None):
    """pipe 2 x data 2, two stages per rank (interleaved), ZeRO-3, every layer its own unit."""
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", stages_per_rank=2)
    settings = config(3, "interleaved", max_active_stages=window)
    settings["zerodist"]["stage3_unit_classes"] = ["Sequential", "Linear"]
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # tiny layers, sharded all the same
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    data_rank = engine.topology.axis_rank("data")
    losses, states, peaks = [], [], []
    for step in range(STEPS):
        engine.units.reset_peak()
        loss = engine.train_batch(iter([micro_batch(step, micro, data_rank, torch.float32) for micro in range(GAS)]))
        peaks.append(engine.units.peak_live_bytes)
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in engine.module_state_dict().items()})
    # what the schedule predicts: each stage's gathered bytes (its units' full flat buffers, padding
    # included: what a gather allocates) while it is gathered
    units_of = StageGathers(engine.units, engine.pipeline, lambda: None).units_of
    stage_bytes = {s: sum(u.nbytes for u in units_of[s]) for s in module.local_stages}
    for s in module.local_stages:  # at least the stage's own parameters
        assert stage_bytes[s] >= 4 * sum(p.numel() for m in module.stage_modules(s) for p in m.parameters())
    predicted = peak_gathered([engine.pipeline.actions()], stage_bytes)[0]
    share = sum(u.nbytes for u in engine.units.units)
    engine.destroy()
    return losses, states, None, None, peaks, predicted, share, max(stage_bytes.values())


@pytest.mark.parametrize("window", [None, 1])
def test_zero3_interleaved_holds_only_the_stages_in_flight(window):
    results = run_distributed(gathered_body, 4, window, timeout=240)  # pipe 2 x data 2: shards of 2
    check_against_reference([r[:4] for r in results], 2, "float32")
    for _, _, _, _, peaks, predicted, share, largest in results:
        assert set(peaks) == {predicted}, (peaks, predicted)  # measured by the runtime = the schedule's
        if window is None:
            assert predicted == share  # interleaved: the first chunk is in flight from the first F to the last B
        else:
            assert predicted == largest < share  # one stage gathered at a time
