"""Stage 3 with overlap_comm: step() issues the next forward's first unit gathers, which the
root's pre-hook only waits for ([Note: early gather] in zerodist/zero/runtime.py). Bitwise the same
training as overlap off, the same collectives, and every other reader or writer finishes or
frees them first."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.harness import run_distributed
from tests.zero.test_param_gather_overlap import assert_states_equal, batch, gpt_engine, train_three_steps
from zerodist.zero.units import UnitState

pytestmark = pytest.mark.multiprocess


def train_body(overlap: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_three_steps(gpt_engine(3, overlap, gas=2))


def test_overlap_on_and_off_train_bitwise_alike():
    on = run_distributed(train_body, 2, True)
    off = run_distributed(train_body, 2, False)
    for (losses_on, state_on), (losses_off, state_off) in zip(on, off):
        assert losses_on == losses_off
        assert_states_equal(state_on, state_off)


def issue_order_body(overlap: bool) -> tuple[list[tuple[str, list[int]]], int, list[str]]:
    """Which `unshard` calls happen in step() and in the next forward, and how many all-gathers."""
    engine = gpt_engine(3, overlap)
    runtime = engine.stage3
    engine.backward(engine(*batch(0)))
    calls: list[tuple[str, list[int]]] = []
    phase = ["step"]
    original = runtime.unshard
    runtime.unshard = lambda units, kind: (calls.append((phase[0], [u.index for u in units])), original(units, kind=kind))
    with comm.trace() as trace:
        engine.step()
        states = [u.state.value for u in runtime.units]
        phase[0] = "forward"
        loss = engine(*batch(1))
    del runtime.unshard  # our own object's method again
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return calls, trace.count("all_gather"), states


def test_the_first_gathers_are_issued_in_step_and_the_forward_issues_the_same_overall():
    on_calls, on_gathers, on_states = run_distributed(issue_order_body, 2, True)[0]
    off_calls, off_gathers, off_states = run_distributed(issue_order_body, 2, False)[0]
    assert off_calls[0][0] == "forward" and off_calls[0][1][0] == 0  # the root's pre-hook
    assert on_calls[0] == ("step", off_calls[0][1])  # the same batch, issued by step()
    assert [units for _, units in on_calls] == [units for _, units in off_calls]
    assert all(phase == "forward" for phase, _ in on_calls[1:])
    assert on_gathers == off_gathers  # fingerprints and gathers: the same collectives
    assert on_states[0] == UnitState.GATHERING.value and set(off_states) == {UnitState.SHARDED.value}


def step_again_body(overlap: bool) -> dict[str, torch.Tensor]:
    """A second backward and step() with no forward in between: the first step's early gathers
    are freed before the shards change again, and the next forward gathers the new values."""
    engine = gpt_engine(3, overlap)
    loss = engine(*batch(0))
    engine.backward(loss, retain_graph=True)
    engine.step()
    engine.backward(loss)
    engine.step()
    engine.backward(engine(*batch(1)))
    engine.step()
    state = engine.module_state_dict()
    engine.destroy()
    return state


def test_a_second_step_without_a_forward_equals_overlap_off():
    on = run_distributed(step_again_body, 2, True)[0]
    off = run_distributed(step_again_body, 2, False)[0]
    assert_states_equal(on, off)


def right_after_step_body(folder: str, overlap: bool) -> tuple[dict[str, torch.Tensor], ...]:
    """save_checkpoint and module_state_dict right after step(); the access check refuses a sharded
    parameter read while the early gathers are pending; destroy() right after a step."""
    engine = gpt_engine(3, overlap)
    engine.backward(engine(*batch(0)))
    engine.step()
    with pytest.raises(zerodist.ShardedParameterError):
        engine.module.blocks[0].mlp.fc_in.weight.sum()
    path = engine.save_checkpoint(folder, tag="right-after-step")
    with pytest.raises(zerodist.ShardedParameterError):
        engine.module.blocks[0].mlp.fc_in.weight.sum()
    state = engine.module_state_dict()
    engine.backward(engine(*batch(1)))
    engine.step()
    if comm.get_rank() == 0:  # a reader on one rank only: it must not start a collective
        assert engine.training_state_dict()
    engine.destroy()  # frees the early gathers: nothing left in flight or gathered
    assert all(u.state is UnitState.SHARDED for u in engine.stage3.units)
    comm.barrier()
    return ckpt.consolidate_checkpoint(path), state


def test_checkpoint_and_state_dict_right_after_step_equal_overlap_off(tmp_path):
    on = run_distributed(right_after_step_body, 2, str(tmp_path / "on"), True)[0]
    off = run_distributed(right_after_step_body, 2, str(tmp_path / "off"), False)[0]
    for state_on, state_off in zip(on, off):
        assert_states_equal(state_on, state_off)
