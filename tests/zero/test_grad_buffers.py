"""Gradient buffers are never zero-filled per step ([Note: no gradient memset] in zerodist/zero/bucket.py),
yet every stage stays exact: a parameter without a gradient gets exactly zero, padding is zero
where a collective reads it, accumulation over 2 and 4 micro-steps matches one process, and
stages 0-3 stay bitwise equal, with every fresh allocation and every stale buffer poisoned with NaN."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import zerodist
import zerodist.comm as comm
from zerodist.models import make_mlp
from tests.engine_helpers import OUT_DIM, assert_close_relative, base_config, global_batch
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

aten = torch.ops.aten
# One flattening plan for every stage, so that stage 3 can be compared bitwise with 0-2 ([Note: one
# plan for every stage]): a unit per Linear, every parameter sharded; several buckets per group.
PLAN = {"zerodist": {"stage3_unit_classes": ["Linear"]},
        "zero_optimization": {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300,
                              "allgather_bucket_size": 300}}
MICRO = 2


class Branchy(torch.nn.Module):
    """An MLP with three extra layers: `first` is used only on a window's first micro-step, `last`
    only on its last one, `never` never (its gradient must come out exactly zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_mlp()
        with torch.random.fork_rng():
            torch.manual_seed(1)
            self.first, self.last, self.never = (torch.nn.Linear(OUT_DIM, OUT_DIM) for _ in range(3))

    def forward(self, x: torch.Tensor, micro_step: int, num_micro_steps: int) -> torch.Tensor:
        y = self.body(x)
        if micro_step == 0:
            y = y + self.first(y)
        if micro_step == num_micro_steps - 1:
            y = y - self.last(y)
        return y


class _Poison(TorchDispatchMode):
    """Fills every fresh allocation (torch.empty and kin) with NaN, as a poisoning allocator does:
    whatever reads memory it did not write first turns the result into NaN."""

    EMPTY = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and out.is_floating_point():
            out.fill_(math.nan)
        return out


class _CountZeroFills(TorchDispatchMode):
    """Elements written with a constant (zero_, fill_, zeros, full and kin), by op."""

    FILLS = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zeros.default, aten.zeros_like.default,
             aten.new_zeros.default, aten.full.default, aten.full_like.default, aten.new_full.default}

    def __init__(self) -> None:
        super().__init__()
        self.filled: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FILLS:
            self.filled.append((str(func), out.numel()))
        return out


def _poison_stale_buffers(engine) -> None:
    """After an optimizer step: what the buffers still hold is stale; make it NaN."""
    for group in engine.groups:
        for buffer in (group.grad_buffer, group.grad_shard):
            if buffer is not None:
                buffer.fill_(math.nan)


def _never_grads(engine) -> list[torch.Tensor]:
    """This rank's owned pieces of `never`'s reduced gradient (after the boundary backward)."""
    pieces = []
    for group in engine.groups:
        owned = torch.cat([g.reshape(-1) for g in group.owned_grads()])
        for piece in group.layout.owned_slices(group.rank):
            if group.records[piece.param_index].name.startswith("never."):
                pieces.append(owned[piece.shard_start: piece.shard_start + piece.length])
    return pieces


def _train(stage: int, gas: int, steps: int, mode_for=lambda step: _Poison()):
    """Train `Branchy` with every buffer poisoned (or under `mode_for(step)`); returns (engine, final
    state, the owned pieces of `never`'s reduced gradient seen at each boundary)."""
    config = base_config(stage, gradient_accumulation_steps=gas, train_micro_batch_size_per_gpu=MICRO, **PLAN)
    engine, *_ = zerodist.initialize(model=Branchy(), config=config)
    n, rank = comm.get_world_size(), comm.get_rank()
    never = []
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * n)
        with mode_for(step):
            for m in range(gas):
                rows = slice((m * n + rank) * MICRO, (m * n + rank + 1) * MICRO)
                engine.backward(F.mse_loss(engine(x[rows], m, gas), y[rows]))
                if m == gas - 1:
                    never += _never_grads(engine)
                engine.step()
        _poison_stale_buffers(engine)
    state = engine.module_state_dict()
    engine.destroy()
    return engine, state, never


def _reference(gas: int, steps: int, n: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch; `never` gets the zero gradient zerodist gives it."""
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * n)
        optimizer.zero_grad()
        rows = [slice(m * n * MICRO, (m + 1) * n * MICRO) for m in range(gas)]
        loss = sum(F.mse_loss(model(x[r], m, gas), y[r]) for m, r in enumerate(rows)) / gas
        loss.backward()
        for p in model.never.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("gas", [1, 2, 4])
@distributed_test(world_size=2, timeout=150)
def test_poisoned_buffers_accumulation_and_unused_parameters_at_every_stage(gas):
    steps = 3
    states = []
    for stage in (0, 1, 2, 3):
        engine, state, never = _train(stage, gas, steps)
        assert len(engine.groups[0].buckets) > 1  # several buckets: padding between them
        assert never and all(torch.equal(p, torch.zeros_like(p)) for p in never), f"stage {stage}: never's gradient"
        assert_close_relative(state, _reference(gas, steps, comm.get_world_size()), 1e-6)
        states.append(state)
    # Accumulating, stages 0/1 reduce the window's sum once and stages 2/3 add each micro-step's
    # reduced shard (another rounding): bitwise equal within each pair, all four with one micro-step.
    for stage, state in enumerate(states[1:], start=1):
        other = 0 if gas == 1 or stage == 1 else 2
        for key in states[other]:
            assert torch.equal(state[key], states[other][key]), f"stage {stage} differs from stage {other} at {key}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_no_gradient_buffer_is_zero_filled_per_step(stage):
    """After the first step (which creates Adam's state), a step zero-fills only padding, the slices
    of parameters without a gradient, and scalars; never a whole gradient buffer."""
    counter = _CountZeroFills()
    engine, _, _ = _train(stage, 2, 4, mode_for=lambda step: _Poison() if step == 0 else counter)
    padding = sum(b.span.numel - sum(group.layout.slots[i].numel for i in b.span.param_indices)
                  for group in engine.groups for b in group.buckets)
    total = sum(group.layout.total_numel for group in engine.groups)
    sometimes_unused = sum(r.slot.numel for group in engine.groups for r in group.records
                           if r.name.split(".")[0] in ("first", "last", "never"))
    # Per window of 2 micro-steps: stages 0/1 settle their persistent buffer once; stages 2/3 each
    # micro-step's staging buffer (where `first` or `last` is then unused too). Scalars: one each.
    per_window = (1 if stage < 2 else 2) * (padding + sometimes_unused)
    assert per_window < (1 if stage < 2 else 2) * total / 2  # a per-step memset would not pass below
    scalars = sum(1 for _, numel in counter.filled if numel == 1)
    filled = sum(numel for _, numel in counter.filled)
    assert filled <= 3 * per_window + scalars, f"stage {stage}: {filled} elements filled in 3 steps: {counter.filled}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_a_skipped_fp16_step_leaves_nothing_stale(stage):
    """An overflow fills the buffers with inf/NaN and the step is skipped; the next window overwrites
    every written slice and zeroes the rest, so training goes on with finite values."""
    config = base_config(stage, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, **PLAN)
    engine, *_ = zerodist.initialize(model=Branchy(), config=config)
    x, y = global_batch(0, 4)
    loss = F.mse_loss(engine(x, 0, 1), y)
    engine.backward(loss * float("inf") if comm.get_rank() == 1 else loss)
    engine.step()
    assert engine.last_step.overflow
    before = engine.module_state_dict()
    with _Poison():
        engine.backward(F.mse_loss(engine(x, 1, 2), y))  # `first` unused now: its slice is stale inf/NaN
        assert all(torch.equal(p, torch.zeros_like(p)) for p in _never_grads(engine))
        engine.step()
    assert not engine.last_step.overflow and math.isfinite(engine.get_global_grad_norm())
    after = engine.module_state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not torch.equal(after["body.0.weight"], before["body.0.weight"])
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1])
@distributed_test(world_size=2)
def test_no_sync_windows_with_stale_buffers(stage):
    """Under no_sync the window spans backwards: a parameter written only in the first still counts as
    written at the boundary, one written in none is zeroed; with no_sync on the boundary too the
    optimizer steps the local gradients, unwritten slices zeroed there."""
    engine, *_ = zerodist.initialize(model=Branchy(), config=base_config(stage, **PLAN))
    rank = comm.get_rank()
    x, y = global_batch(0, 8)
    rows = [slice((m * 2 + rank) * 2, (m * 2 + rank + 1) * 2) for m in (0, 1)]
    mine = [(x[r], y[r]) for r in rows]
    reference = Branchy()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    sum(F.mse_loss(reference(x[m * 4: m * 4 + 4], m, 2), y[m * 4: m * 4 + 4]) for m in (0, 1)).backward()
    for p in reference.never.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for boundary_in_no_sync in (False, True):
        _poison_stale_buffers(engine)
        with _Poison():
            with engine.no_sync():
                engine.backward(F.mse_loss(engine(mine[0][0], 0, 2), mine[0][1]), scale_wrt_gas=False)
            with engine.no_sync() if boundary_in_no_sync else contextlib.nullcontext():
                engine.backward(F.mse_loss(engine(mine[1][0], 1, 2), mine[1][1]), scale_wrt_gas=False)
            engine.step()
        after = engine.module_state_dict()
        assert all(torch.isfinite(v).all() for v in after.values())
        if not boundary_in_no_sync:
            assert_close_relative(after, reference.state_dict(), 1e-6)
    engine.destroy()
