"""Engine behaviour: exact communication and memory, overflow, groups, schedulers, misuse."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.engine.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerodist.models import make_mlp
from tests.engine_helpers import (assert_close_relative, base_config, global_batch, train_distributed,
                                  train_reference)
from tests.harness import DistributedTestFailure, distributed_test, run_distributed


def _one_step(engine, rows=4):
    x, y = global_batch(0, rows)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()


# ---------------------------------------------------------------- communication volume

@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=[2, 4])
def test_communication_per_step_is_two_psi(world_size, stage):
    n = world_size
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage, zero_optimization={
        "reduce_bucket_size": 600, "allgather_bucket_size": 600}))
    psi = sum(g.layout.total_numel for g in engine.groups)  # padded
    _one_step(engine)  # warm-up: optimizer state exists
    with comm.trace() as t:
        _one_step(engine)
    buckets = len(engine.groups[0].buckets)
    if stage == 0:  # data parallelism as DDP does it: one all-reduce per bucket (+ the step's 2 elements)
        assert t.count("reduce_scatter") == 0 and t.count("all_gather") == 0
        assert t.count("all_reduce") == buckets + 1 and t.total_numel("all_reduce") == psi + 2
        assert t.bus_elements("all_reduce") == pytest.approx(2 * (psi + 2) * (n - 1) / n)
        return
    grad_and_param = t.bus_elements("reduce_scatter") + t.bus_elements("all_gather")
    assert grad_and_param == pytest.approx(2 * psi * (n - 1) / n)
    assert t.total_numel("reduce_scatter") == psi and t.total_numel("all_gather") == psi
    # The only all-reduce is the step's: the global gradient norm and the overflow flag; no
    # gradient is all-reduced.
    assert t.count("all_reduce") == 1 and t.total_numel("all_reduce") == 2
    assert t.count("reduce_scatter") == buckets


@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_reduce_scatter_false_all_reduces_gradients(stage):
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage, zero_optimization={
        "reduce_scatter": False}))
    psi = sum(g.layout.total_numel for g in engine.groups)
    with comm.trace() as t:
        _one_step(engine)
    assert t.count("reduce_scatter") == 0
    assert t.total_numel("all_reduce") == psi + 2  # gradients + the norm and the overflow flag
    assert t.total_numel("all_gather") == (0 if stage == 0 else psi)


# ---------------------------------------------------------------- memory: docs/design/zero.md's table

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=[2, 4])
def test_model_state_bytes_follow_the_zero_table(world_size, stage, precision):
    n = world_size
    config = base_config(stage, zero_optimization={"reduce_bucket_size": 500, "allgather_bucket_size": 500})
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config)
    _one_step(engine)  # Adam's states exist after the first step
    psi = sum(g.layout.total_numel for g in engine.groups)
    assert psi % (n * 64) == 0 and psi >= sum(p.numel() for p in make_mlp().parameters())
    measured = engine.model_state_bytes()
    expected = {  # (params, grads, optimizer) in bytes, Ψ padded
        ("fp32", 0): (4 * psi, 4 * psi, 8 * psi),
        ("fp32", 1): (4 * psi, 4 * psi, 8 * psi // n),
        ("fp32", 2): (4 * psi, 4 * psi // n, 8 * psi // n),
        ("bf16", 0): (2 * psi, 2 * psi, 12 * psi),
        ("bf16", 1): (2 * psi, 2 * psi, 12 * psi // n),
        ("bf16", 2): (2 * psi, 2 * psi // n, 12 * psi // n),
    }[(precision, stage)]
    assert (measured["params"], measured["grads"], measured["optimizer"]) == expected
    table_total = {("fp32", 0): 16 * psi, ("fp32", 1): 8 * psi + 8 * psi // n, ("fp32", 2): 4 * psi + 12 * psi // n,
                   ("bf16", 0): 16 * psi, ("bf16", 1): 4 * psi + 12 * psi // n, ("bf16", 2): 2 * psi + 14 * psi // n}
    assert measured["total"] == table_total[(precision, stage)]


@distributed_test(world_size=2)
def test_fp32_shard_is_a_view_of_the_parameters():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(2))
    group = engine.groups[0]
    assert group.master is None
    for tensor in group.optimizer_tensors:
        assert tensor.untyped_storage().data_ptr() == group.param_buffer.untyped_storage().data_ptr()
    for param in engine.module.parameters():
        assert param.untyped_storage().data_ptr() == group.param_buffer.untyped_storage().data_ptr()


# ---------------------------------------------------------------- fp16 overflow

@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_fp16_overflow_on_one_rank_makes_every_rank_skip(stage):
    config = base_config(stage, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config)
    before = engine.module_state_dict()
    x, y = global_batch(0, 4)
    loss = F.mse_loss(engine(x), y)
    if comm.get_rank() == 1:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and engine.last_step.overflow
    assert engine.loss_scale == 2.0**7  # halved once, on every rank
    for key, value in engine.module_state_dict().items():
        assert torch.equal(value, before[key]), key
    _one_step(engine)  # and training goes on
    assert engine.skipped_steps == 1 and not engine.last_step.overflow
    assert any(not torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    assert engine.optimizer.scaler.state_dict()["num_overflows"] == 1


@pytest.mark.unit
def test_loss_scaler_hysteresis_and_window():
    from zerodist.precision import LossScaler

    scaler = LossScaler(dynamic=True, init_scale=1024, scale_window=2, hysteresis=2, min_scale=256)
    scaler.update(True)
    assert scaler.scale == 1024  # hysteresis absorbs the first overflow
    scaler.update(True)
    assert scaler.scale == 512
    scaler.update(False), scaler.update(False)
    assert scaler.scale == 1024  # a clean window doubles it
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale == 256  # never below min_loss_scale
    restored = LossScaler(dynamic=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


# ---------------------------------------------------------------- user optimizers and groups

def _two_group_optimizer(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}],
                             lr=1e-2, betas=(0.8, 0.95))


@pytest.mark.parametrize("stage", [0, 2])
@distributed_test(world_size=2)
def test_user_optimizer_with_two_param_groups(stage):
    model = make_mlp()
    user_opt = _two_group_optimizer(model)
    config = base_config(stage)
    del config["optimizer"]
    engine, opt, _, _ = zerodist.initialize(model=model, optimizer=user_opt, config=config)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 5e-3] and opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert user_opt.state == {}  # the user's instance is never stepped
    trained = make_mlp()
    _, state = train_distributed(config, 8, model=trained, optimizer=_two_group_optimizer(trained))
    ref_model = make_mlp()
    reference, _ = train_reference(8, rows=8, model=ref_model, optimizer=_two_group_optimizer(ref_model))
    assert_close_relative(state, reference, 1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_an_empty_param_group_stays_a_group_through_training_and_a_checkpoint(stage):
    """HF's Trainer makes [decay, no_decay] groups, the second empty under LoRA: the returned optimizer
    keeps both, so a scheduler with one entry per group lines up; it trains like one process, and its
    checkpoint loads back into the same groups, options and scheduler state included."""
    import tempfile

    def grouped(model: torch.nn.Module, empty_first: bool) -> torch.optim.Optimizer:
        groups = [{"params": list(model.parameters()), "weight_decay": 0.1},
                  {"params": [], "weight_decay": 0.0, "lr": 5e-3}]
        return torch.optim.AdamW(groups[::-1] if empty_first else groups, lr=1e-2)

    def schedule(optimizer: Any, empty_first: bool) -> Any:
        lambdas = [lambda s: 1.0 / (s + 1), lambda s: 0.5 ** s]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas[::-1] if empty_first else lambdas)

    config = base_config(stage, zero_optimization={"stage3_param_persistence_threshold": 0})
    del config["optimizer"]
    for empty_first in (False, True):
        reference = make_mlp()
        reference_optimizer = grouped(reference, empty_first)
        reference_schedule = schedule(reference_optimizer, empty_first)
        for step in range(3):
            x, y = global_batch(step, 8)
            reference_optimizer.zero_grad()
            F.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
            reference_schedule.step()
        model = make_mlp()
        engine, state = train_distributed(config, 3, model=model, optimizer=grouped(model, empty_first),
                                          lr_scheduler=lambda opt, e=empty_first: schedule(opt, e))
        assert_close_relative(state, {k: v.detach() for k, v in reference.state_dict().items()}, 1e-6)
        groups = engine.optimizer.param_groups
        assert len(groups) == 2 and groups[0 if empty_first else 1]["params"] == []
        assert [g["lr"] for g in groups] == [g["lr"] for g in reference_optimizer.param_groups]
        directory = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(directory, src=0)
        engine.save_checkpoint(directory[0], tag="groups")
        loaded_model = make_mlp(seed=3)
        loaded, loaded_optimizer, _, _ = zerodist.initialize(
            model=loaded_model, optimizer=grouped(loaded_model, empty_first), config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 1.0]))
        loaded.load_checkpoint(directory[0], tag="groups")
        assert [g["lr"] for g in loaded_optimizer.param_groups] == [g["lr"] for g in groups]
        assert [g["weight_decay"] for g in loaded_optimizer.param_groups] == [g["weight_decay"] for g in groups]
        saved, restored = engine.module_state_dict(), loaded.module_state_dict()
        for key, value in saved.items():
            assert torch.equal(restored[key], value), key
        loaded.destroy()
        engine.destroy()


@distributed_test(world_size=1)
def test_optimizer_misuse_is_explained():
    # DeepSpeed's engine without an optimizer: forward and backward run, step() names the fix
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config={"steps_per_print": 100})
    engine.backward(engine(torch.randn(2, engine.module[0].in_features)).sum())
    with pytest.raises(zerodist.ConfigError, match="no optimizer"):
        engine.step()
    with pytest.raises(zerodist.ConfigError, match="did you mean 'Adam'"):
        zerodist.initialize(model=make_mlp(), config={"optimizer": {"type": "AdamX", "params": {}}})
    with pytest.raises(zerodist.ConfigError, match="not arguments of torch.optim.AdamW"):
        zerodist.initialize(model=make_mlp(), config={"optimizer": {"type": "AdamW", "params": {"lrr": 1}}})
    model = make_mlp()
    with pytest.raises(ValueError, match="not elementwise"):
        zerodist.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()))
    model = make_mlp()
    with pytest.raises(ValueError, match=r"require grad but are in no optimizer param group"):
        zerodist.initialize(model=model, optimizer=torch.optim.SGD(list(model.parameters())[:2], lr=0.1))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_a_frozen_model_without_an_optimizer_runs_forward(stage):
    """A reference or teacher model (TRL's create_reference_model freezes every parameter), given no
    optimizer: the engine builds at every stage and its outputs are those of the model alone; asking
    for an optimizer over it is refused by name (torch's "empty parameter list" said nothing)."""
    reference = make_mlp().requires_grad_(False)
    model = make_mlp().requires_grad_(False)
    model.load_state_dict(reference.state_dict())
    engine, optimizer, _, _ = zerodist.initialize(model=model, config={"zero_optimization": {"stage": stage},
                                                                       "train_micro_batch_size_per_gpu": 2})
    engine.eval()
    x = torch.randn(4, engine.module[0].in_features, generator=torch.Generator().manual_seed(comm.get_rank()))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    assert optimizer.state_bytes() == 0
    with pytest.raises(zerodist.ConfigError, match="no parameter of the model requires grad"):
        zerodist.initialize(model=make_mlp().requires_grad_(False),
                            config={"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW"}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_an_engine_without_an_optimizer_keeps_no_fp32_master(stage):
    """bf16 without an optimizer (TRL's reference model: from_pretrained, so trainable, prepared with
    no optimizer): no fp32 master, 4 bytes per parameter nothing would ever step; the outputs are the
    bf16 model's, backward runs, and its checkpoint loads into an engine that trains."""
    import copy
    import tempfile

    reference = make_mlp()
    model = make_mlp()
    model.load_state_dict(reference.state_dict())
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}
    engine, optimizer, _, _ = zerodist.initialize(model=model, config=config)
    assert optimizer.state_bytes() == 0 and all(g.master is None for g in engine.zero_state.groups)
    x = torch.randn(4, reference[0].in_features, generator=torch.Generator().manual_seed(comm.get_rank()))
    with torch.no_grad():
        assert torch.equal(engine(x.bfloat16()), copy.deepcopy(reference).to(torch.bfloat16)(x.bfloat16()))
    engine.backward(engine(x.bfloat16()).float().pow(2).mean())  # runs; step() would refuse
    directory = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    engine.save_checkpoint(directory[0], tag="ref")
    trained, _, _, _ = zerodist.initialize(model=make_mlp(seed=1), config={**config, "optimizer": {"type": "AdamW"}})
    trained.load_checkpoint(directory[0], tag="ref", load_optimizer_states=False)
    for key, value in reference.state_dict().items():
        assert torch.equal(trained.module_state_dict()[key].bfloat16(), value.bfloat16()), key


@distributed_test(world_size=1)
def test_deepspeed_adam_is_decoupled_unless_asked():
    engine, opt, _, _ = zerodist.initialize(model=make_mlp(), config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert type(opt.inner).__name__ == "AdamW"
    engine, opt, _, _ = zerodist.initialize(model=make_mlp(), config={"optimizer": {
        "type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True}}})
    assert type(opt.inner).__name__ == "Adam"


# ---------------------------------------------------------------- schedulers

class _FakeOptimizer:
    def __init__(self, lr=0.1):
        self.param_groups = [{"lr": lr, "betas": (0.9, 0.999)}]


@pytest.mark.unit
def test_deepspeed_schedules_follow_their_formulas():
    # Built at iteration -1 (the warmup minimum), then step() moves one iteration: [Note: schedule iterations].
    s = WarmupLR(_FakeOptimizer(), warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=100, warmup_type="log")
    assert s.get_last_lr() == [0.0]
    s.step()
    assert s.get_last_lr() == [0.0]  # iteration 0: log(1) = 0
    for _ in range(9):
        s.step()
    assert s.get_last_lr()[0] == pytest.approx(0.01 * math.log(10) / math.log(100))
    s = WarmupLR(_FakeOptimizer(), warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    for _ in range(20):
        s.step()
    assert s.get_last_lr() == [0.01]
    s = WarmupDecayLR(_FakeOptimizer(), total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    for _ in range(16):
        s.step()
    assert s.get_last_lr()[0] == pytest.approx(0.01 * 5 / 10)  # iteration 15
    s = WarmupCosineLR(_FakeOptimizer(0.1), total_num_steps=110, warmup_num_steps=10, cos_min_ratio=0.0,
                       warmup_type="linear")
    assert s.get_last_lr() == [0.0]
    for _ in range(60):
        s.step()
    assert s.get_last_lr()[0] == pytest.approx(0.1 * 0.5)  # iteration 59: half way down the cosine
    opt = _FakeOptimizer()
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)
    assert s.get_last_lr() == [0.01] and opt.param_groups[0]["betas"][0] == pytest.approx(0.8)
    for _ in range(10):
        s.step()
    assert s.get_last_lr()[0] == pytest.approx(0.1) and opt.param_groups[0]["betas"][0] == pytest.approx(0.8)
    resumed = WarmupLR(_FakeOptimizer(), warmup_max_lr=0.01, warmup_num_steps=100)
    source = WarmupLR(_FakeOptimizer(), warmup_max_lr=0.01, warmup_num_steps=100)
    for _ in range(7):
        source.step()
    resumed.load_state_dict(source.state_dict())
    assert resumed.get_last_lr() == source.get_last_lr()


_SCHEDULE_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_max_lr": 0.01, "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 6, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_momentum": False,
                  "decay_lr_rate": 0.5, "decay_step_size": 2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_second_step_size": 7,
                  "cycle_momentum": False}),
]


@pytest.mark.unit
@pytest.mark.parametrize("name, params", _SCHEDULE_CASES)
def test_schedules_match_deepspeed_step_for_step(name, params):
    """Where DeepSpeed is installed: the rate every step uses, from construction over 30 steps,
    equals DeepSpeed's own schedule's (the same iteration numbering, [Note: schedule iterations])."""
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from zerodist.engine.schedulers import SCHEDULES

    theirs_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ours_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs, ours = getattr(schedules, name)(theirs_opt, **params), SCHEDULES[name](ours_opt, **params)
    for _ in range(30):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        theirs.step(), ours.step()


@distributed_test(world_size=2)
def test_config_and_user_schedulers_drive_the_sharded_optimizer():
    config = base_config(1, scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 4,
                                                                      "warmup_type": "linear"}})
    engine, _, _, sched = zerodist.initialize(model=make_mlp(), config=config)
    lrs = []
    for _ in range(5):
        _one_step(engine)
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.0, 0.005, 0.01, 0.015, 0.02])  # the rate of the next step
    model = make_mlp()
    user_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    user_sched = torch.optim.lr_scheduler.StepLR(user_opt, step_size=1, gamma=0.5)
    config = base_config(2)
    del config["optimizer"]
    engine, _, _, sched = zerodist.initialize(model=model, optimizer=user_opt, lr_scheduler=user_sched, config=config)
    _one_step(engine), _one_step(engine)
    assert engine.get_lr() == pytest.approx([0.025])
    engine, _, _, sched = zerodist.initialize(
        model=make_mlp(), config=base_config(0),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1)))
    _one_step(engine)
    assert engine.get_lr() == pytest.approx([0.005])


# ---------------------------------------------------------------- no_sync, boundaries

@pytest.mark.parametrize("stage", [0, 1])
@distributed_test(world_size=2)
def test_no_sync_accumulates_then_reduces_the_sum(stage):
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage))
    rank = comm.get_rank()
    x, y = global_batch(0, 16)
    with comm.trace() as t:
        with engine.no_sync():
            engine.backward(F.mse_loss(engine(x[rank * 4: rank * 4 + 4]), y[rank * 4: rank * 4 + 4]))
    assert t.count() == 0  # nothing communicated inside no_sync
    engine.backward(F.mse_loss(engine(x[8 + rank * 4: 12 + rank * 4]), y[8 + rank * 4: 12 + rank * 4]))
    engine.step()
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loss = sum(F.mse_loss(model(x[r * 4: r * 4 + 4]), y[r * 4: r * 4 + 4]) +
               F.mse_loss(model(x[8 + r * 4: 12 + r * 4]), y[8 + r * 4: 12 + r * 4]) for r in range(2)) / 2
    loss.backward()
    opt.step()
    assert_close_relative(engine.module_state_dict(), model.state_dict(), 1e-6)


@distributed_test(world_size=2)
def test_no_sync_is_refused_at_stage_2():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(2))
    with pytest.raises(RuntimeError, match="no_sync\\(\\) is not available at ZeRO stage 2"):
        with engine.no_sync():
            pass


@distributed_test(world_size=1)
def test_boundary_is_explicit_and_overridable():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(1, gradient_accumulation_steps=3))
    seen = []
    for _ in range(6):
        seen.append(engine.is_gradient_accumulation_boundary())
        _one_step(engine)
    assert seen == [False, False, True, False, False, True] and engine.global_steps == 2
    engine.set_gradient_accumulation_boundary(True)
    _one_step(engine)
    assert engine.global_steps == 3


# ---------------------------------------------------------------- the user's objects

class _Expert(torch.nn.Module):
    def __init__(self, expert_id):
        super().__init__()
        self.id = expert_id  # users place experts by this attribute
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _MoEish(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([_Expert(i + 10) for i in range(3)])

    def forward(self, x):
        return sum(e(x) for e in self.experts)


def _attributes(model):
    modules = {name: sorted(vars(m)) for name, m in model.named_modules()}
    params = {name: sorted(vars(p)) for name, p in model.named_parameters()}
    return modules, params


@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_no_attribute_is_set_on_user_objects(stage):
    model = _MoEish()
    before = _attributes(model)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage))
    x = torch.randn(2, 4)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert _attributes(model) == before
    assert [e.id for e in model.experts] == [10, 11, 12]
    with pytest.raises(RuntimeError, match="initialize\\(\\) was already called"):
        zerodist.initialize(model=model, config=base_config(stage))


@pytest.mark.parametrize("stage", [0, 3])
@distributed_test(world_size=2)
def test_a_dropped_engine_is_freed(stage):
    """Without destroy(): gradient hooks live on the parameters, where the garbage collector
    cannot see them, so a hook holding the engine's state would keep it alive for good."""
    model = make_mlp()
    engine = zerodist.initialize(model=model, config=base_config(stage))[0]
    _one_step(engine)
    group = weakref.ref(engine.groups[0])
    del engine, model
    gc.collect()
    assert group() is None


@distributed_test(world_size=1)
def test_step_without_engine_backward_is_explained():
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(0))
    x, y = global_batch(0, 4)
    with pytest.raises(RuntimeError, match=r"engine.backward\(loss\) \(not loss.backward\(\)\)"):
        engine.step()
    with pytest.raises(ValueError, match="takes the scalar loss"):
        engine.backward(engine(x))


class _RankDivergent(torch.nn.Module):
    """Rank 1 skips `extra`, so its gradient is missing there: buckets must still pair up."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.extra, self.last = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.first(x)
        if comm.get_rank() == 0:
            h = self.extra(h)
        return self.last(h)


@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_parameter_unused_on_one_rank_does_not_hang(stage):
    engine, _, _, _ = zerodist.initialize(model=_RankDivergent(), config=base_config(stage, zero_optimization={
        "reduce_bucket_size": 80, "allgather_bucket_size": 80}))
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    both = torch.empty(2 * flat.numel())
    comm.all_gather(both, flat)
    assert torch.equal(both[: flat.numel()], both[flat.numel():])


def _initialize_with_rank_dependent_config():
    config = base_config(2 if comm.get_rank() == 0 else 1)
    zerodist.initialize(model=make_mlp(), config=config)


@pytest.mark.multiprocess
def test_ranks_with_different_configs_fail_on_every_rank():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_initialize_with_rank_dependent_config, 2, timeout=60)
    message = str(info.value)
    assert "failed on 2 of 2" in message and "the ranks disagree on the config" in message


@distributed_test(world_size=2)
def test_batch_triple_error_names_the_world_size():
    with pytest.raises(zerodist.ConfigError, match=r"data-parallel world size \(2, from torchrun"):
        zerodist.initialize(model=make_mlp(), config=base_config(0, train_batch_size=12))


# ---------------------------------------------------------------- data

@distributed_test(world_size=2)
def test_engine_loader_reshuffles_every_epoch_and_splits_ranks():
    data = torch.utils.data.TensorDataset(torch.arange(32.0).unsqueeze(1))
    engine, _, loader, _ = zerodist.initialize(model=make_mlp(), config=base_config(0), training_data=data)
    epochs = [[int(v) for batch in loader for v in batch[0].reshape(-1)] for _ in range(2)]
    assert epochs[0] != epochs[1] and len(epochs[0]) == len(epochs[1]) == 16
    for epoch in epochs:
        both = torch.empty(32)
        comm.all_gather(both, torch.tensor(epoch, dtype=torch.float32))
        assert sorted(both.tolist()) == list(range(32))  # the ranks' slices partition the data
