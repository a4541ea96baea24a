"""Stages 1-2 overlap the updated parameters' all-gather with the next forward (overlap_comm):
bitwise the same training as the synchronous gather, gathers issued in step() and waited for in
the forward unit by unit, and every other reader (the user's own torch calls, checkpoints) waits
first ([Note: overlapped parameter gather] in zerodist/zero/runtime.py)."""

from __future__ import annotations

import gc
import io
import time

import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.harness import run_distributed
from zerodist.models import GPT, GPTConfig
from zerodist.zero import sharded_access
from zerodist.zero.flat_group import PendingGather

pytestmark = pytest.mark.multiprocess

SEQ = 16


def assert_states_equal(on: dict[str, torch.Tensor], off: dict[str, torch.Tensor]) -> None:
    """The same keys, and every tensor bitwise equal."""
    assert on.keys() == off.keys()
    for key in on:
        assert torch.equal(on[key], off[key]), key


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=SEQ, d_model=32, n_layers=3, n_heads=2))


class ReadsAhead(torch.nn.Module):
    """A forward that reads the last block's weight before any block (and its pre-hook) runs."""

    def __init__(self):
        super().__init__()
        self.gpt = small_gpt()
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.gpt.blocks[2].mlp.fc_out.weight.sum().item())
        return self.gpt(x, y)


def gpt_engine(stage: int, overlap: bool, gas: int = 1, model: torch.nn.Module | None = None):
    """A 3-block GPT whose blocks are units of their own (threshold 100: LayerNorms and biases are
    persistent), so stages 1/2 gather root, per-block and persistent groups."""
    model = model if model is not None else small_gpt()
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap, "stage3_param_persistence_threshold": 100,
                              "reduce_bucket_size": 2500, "allgather_bucket_size": 2500},
    }
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    return engine


def batch(step: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + comm.get_rank())
    tokens = torch.randint(0, 256, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_body(stage: int, overlap: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = gpt_engine(stage, overlap, gas=2)
    assert engine.units.overlap is overlap
    assert len(engine.units.gather_groups) >= 5  # root, 3 blocks, persistent
    return train_three_steps(engine)


def train_three_steps(engine) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three optimizer steps of two micro-steps each (an engine built with gas=2), an eval forward
    after every step; the losses and the final module state. Destroys the engine."""
    losses = []
    for step in range(3):
        for micro in range(2):
            x, y = batch(2 * step + micro)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()
        with torch.no_grad():
            losses.append(engine(*batch(99)).item())
        engine.train()
    state = engine.module_state_dict()
    engine.destroy()
    return losses, state


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_on_and_off_train_bitwise_alike(stage):
    on = run_distributed(train_body, 2, stage, True)
    off = run_distributed(train_body, 2, stage, False)
    for (losses_on, state_on), (losses_off, state_off) in zip(on, off):
        assert losses_on == losses_off
        assert_states_equal(state_on, state_off)


def event_order_body(overlap: bool) -> tuple[int, int, list[tuple[str, str]]]:
    gc.collect()  # engines of earlier tests in this worker process: their registrations go with them
    engine = gpt_engine(2, overlap)
    schedule = engine.units
    engine.backward(engine(*batch(0)))
    with comm.trace() as trace:
        engine.step()
    issued = trace.count("all_gather")
    pending_after_step = len(schedule.pending)
    names = {id(g): g.records[0].name for g in schedule.gather_groups}
    events: list[tuple[str, str]] = []
    original = PendingGather.wait
    owner = {}

    def recording_wait(self):
        if self.handles:  # a real wait, not the second call of a finished one
            events.append(("wait", owner[id(self)]))
        original(self)

    owner.update({id(g.pending_gather): names[id(g)] for g in schedule.pending})
    units = [engine.module, *engine.module.blocks]
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", f"unit {i}")))
             for i, m in enumerate(units)]
    # the check waits for stray reads while gathers pend, and is off once the last unit's is waited for
    checked = []
    hooks += [m.register_forward_pre_hook(lambda m, a: checked.append(sharded_access.is_installed()))
              for m in (units[1], units[-1])]
    PendingGather.wait = recording_wait
    try:
        engine(*batch(1))
    finally:
        PendingGather.wait = original
        for hook in hooks:
            hook.remove()
    expected = []
    if overlap:  # each unit's groups just before it runs: root and persistent first
        for unit in range(len(units)):
            expected += [("wait", names[id(g)]) for g in schedule.gathers_by_unit[unit]] + [("forward", f"unit {unit}")]
    else:
        expected = [("forward", f"unit {unit}") for unit in range(len(units))]
    assert events == expected, events
    assert checked == ([True, False] if overlap else [False, False]), (checked, sharded_access.num_pending())
    assert not schedule.pending and not sharded_access.is_installed()
    engine.destroy()
    return issued, pending_after_step, events


def test_gathers_are_issued_in_step_and_waited_for_unit_by_unit_in_the_forward():
    issued, pending, events = run_distributed(event_order_body, 2, True)[0]
    assert issued >= 5 and pending >= 5
    assert events[0][0] == "wait" and events[-1][0] == "forward"
    issued_off, pending_off, _ = run_distributed(event_order_body, 2, False)[0]
    assert issued_off == issued and pending_off == 0


def start_late_on_rank_1(engine, after_root: bool = False) -> None:
    """Rank 1 issues its gathers (`after_root`: those after the root's and the persistent ones)
    0.3 s late, so rank 0's are still in flight when it reads."""
    schedule = engine.units
    if comm.get_rank() == 1:
        def late_start():
            first = schedule.gathers_by_unit[0] if after_root else []
            for group in first:
                group.start_unshard()
            time.sleep(0.3)
            for group in schedule.gather_groups:
                if group not in first:
                    group.start_unshard()
            if not schedule.overlap:
                schedule.wait_updated()
        schedule.after_step = late_start  # our own object, not the user's


def direct_access_body(overlap: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Right after step(), before any forward: the user reads a parameter and saves the state dict."""
    engine = gpt_engine(1, overlap)
    schedule = engine.units
    start_late_on_rank_1(engine)
    engine.backward(engine(*batch(0)))
    engine.step()
    weight = engine.module.blocks[2].mlp.fc_out.weight
    total = weight.sum().item()  # what print(model...weight.sum()) shows
    group = next(g for g in schedule.gather_groups if any(p is weight for p in g.params))
    assert not group.is_gathering_params  # the read waited for it
    saved = io.BytesIO()
    torch.save(engine.module.state_dict(), saved)
    assert not schedule.pending and sharded_access.num_pending() == 0
    engine.finish_param_gathers()
    assert total == weight.sum().item()
    saved.seek(0)
    state = torch.load(saved)
    engine.destroy()
    return total, state


def test_reading_parameters_between_step_and_forward_waits_for_the_gather():
    on = run_distributed(direct_access_body, 2, True)
    off = run_distributed(direct_access_body, 2, False)
    for (total_on, state_on), (total_off, state_off) in zip(on, off):
        assert total_on == total_off
        assert_states_equal(state_on, state_off)


def checkpoint_body(folder: str, overlap: bool) -> dict[str, torch.Tensor]:
    engine = gpt_engine(2, overlap)
    for step in range(2):
        engine.backward(engine(*batch(step)))
        engine.step()
    if overlap:
        assert engine.units.pending
    path = engine.save_checkpoint(folder, tag="right-after-step")
    assert not engine.units.pending
    engine.destroy()
    comm.barrier()
    return ckpt.consolidate_checkpoint(path)


def test_a_checkpoint_saved_right_after_step_equals_the_synchronous_one(tmp_path):
    on = run_distributed(checkpoint_body, 2, str(tmp_path / "on"), True)[0]
    off = run_distributed(checkpoint_body, 2, str(tmp_path / "off"), False)[0]
    assert_states_equal(on, off)


def reads_ahead_body(overlap: bool) -> float:
    model = ReadsAhead()
    engine = gpt_engine(2, overlap, model=model)
    start_late_on_rank_1(engine, after_root=True)
    engine.backward(engine(*batch(0)))
    engine.step()
    engine(*batch(1))  # reads blocks.2's weight before blocks.2's pre-hook waited for it
    assert model.seen[-1] == model.gpt.blocks[2].mlp.fc_out.weight.sum().item()
    engine.destroy()
    return model.seen[-1]


def test_a_forward_reading_a_later_unit_first_waits_for_its_gather():
    assert run_distributed(reads_ahead_body, 2, True) == run_distributed(reads_ahead_body, 2, False)


def step_again_body(overlap: bool) -> dict[str, torch.Tensor]:
    """A second backward and step() with no forward in between (a retained graph backpropagated
    twice): that backward reads the parameters its graph saved, and the optimizer steps their
    buffers, both after the first step's gather finished writing them (without the wait in
    backward the results differ)."""
    engine = gpt_engine(1, overlap)
    loss = engine(*batch(0))
    engine.backward(loss, retain_graph=True)
    engine.step()
    pending = len(engine.units.pending)
    engine.backward(loss)
    engine.step()
    assert pending == (len(engine.units.gather_groups) if overlap else 0)
    state = engine.module_state_dict()
    engine.destroy()
    return state


def test_a_second_step_without_a_forward_waits_for_the_first_steps_gather():
    on = run_distributed(step_again_body, 2, True)[0]
    off = run_distributed(step_again_body, 2, False)[0]
    assert_states_equal(on, off)


def stage3_persistent_body() -> None:
    """Stage 3's persistent groups (LayerNorms, biases) are gathered like stage 2's: waited for at
    the root; the access check still refuses sharded parameters after that forward."""
    engine = gpt_engine(3, True)
    schedule = engine.units
    assert schedule.gather_groups and all(not g.policy.shard_parameters for g in schedule.gather_groups)
    engine.backward(engine(*batch(0)))
    engine.step()
    assert schedule.pending and sharded_access.is_installed()
    engine.backward(engine(*batch(1)))
    assert not schedule.pending and sharded_access.is_installed()
    with pytest.raises(zerodist.ShardedParameterError):
        engine.module.blocks[0].mlp.fc_in.weight.sum()
    engine.step()
    engine.destroy()


def test_stage3_persistent_groups_overlap_and_the_access_check_stays():
    run_distributed(stage3_persistent_body, 2)


def dropped_body() -> None:
    engine = gpt_engine(2, True)
    engine.backward(engine(*batch(0)))
    engine.step()  # also finishes the done gathers of engines earlier tests left in this worker
    assert sharded_access.num_pending() == len(engine.units.gather_groups)
    del engine  # no destroy(), no forward: the gathers are still in flight
    gc.collect()
    assert sharded_access.num_pending() == 0  # its groups waited for them when collected


def test_an_engine_dropped_right_after_step_leaves_no_gather_registered():
    run_distributed(dropped_body, 2)
