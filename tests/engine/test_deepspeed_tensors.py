"""DeepSpeed's per-parameter accessors (`deepspeed.utils.safe_get_full_fp32_param` and kin,
zerodist/engine/deepspeed_tensors.py) on 2 ranks, compared with one process: the whole gradient after
backward is the one-process model's gradient of the global batch, the whole fp32 value after the
step is its parameter, the local partitions of the ranks tile the whole, and a write is what the
next read and the optimizer step see."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.engine import deepspeed_tensors as ds
from zerodist.models import make_mlp
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

ROWS = 4  # per rank


def _reference(steps: int) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """One process, the whole global batch: the model after `steps` AdamW steps and each step's gradients."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    grads = []
    for step in range(steps):
        x, y = global_batch(step, ROWS * 2)
        F.mse_loss(model(x), y).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return model, grads


def _engine(stage: int) -> object:
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage))
    return engine


def _micro_step(engine: object, step: int) -> None:
    rank = comm.get_rank()
    x, y = global_batch(step, ROWS * 2)
    loss = F.mse_loss(engine(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
    engine.backward(loss)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_full_values_equal_one_process(stage):
    reference, grads = _reference(2)
    engine = _engine(stage)
    params = dict(engine.module.named_parameters())
    for step in range(2):
        _micro_step(engine, step)
        for name, param in params.items():
            torch.testing.assert_close(ds.safe_get_full_grad(param), grads[step][name], rtol=0, atol=1e-6)
        engine.step()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), param.detach(), rtol=0, atol=1e-6)
        assert ds.safe_get_full_optimizer_state(params[name], "exp_avg").shape == param.shape
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
@distributed_test(world_size=2)
def test_local_partitions_tile_the_whole(stage):
    engine = _engine(stage)
    _micro_step(engine, 0)
    engine.step()
    for param in engine.module.parameters():
        for kind in ("fp32", "exp_avg_sq"):
            local = ds.safe_get_local_fp32_param(param) if kind == "fp32" else \
                ds.safe_get_local_optimizer_state(param, kind)
            whole = ds.safe_get_full_fp32_param(param) if kind == "fp32" else \
                ds.safe_get_full_optimizer_state(param, kind)
            pieces = [torch.zeros(0)] * 2
            torch.distributed.all_gather_object(pieces, local)
            assert sum(p.numel() for p in pieces) == param.numel()  # each element owned by one rank
            torch.testing.assert_close(torch.cat(pieces), whole.reshape(-1), rtol=0, atol=0)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2, 3])
@distributed_test(world_size=2)
def test_writes_are_what_the_step_uses(stage):
    """A whole gradient written between backward and step is what the step uses (compared with one
    process stepping the same gradient), and a written fp32 value reaches the parameter itself."""
    engine = _engine(stage)
    reference = make_mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    params = dict(engine.module.named_parameters())
    _micro_step(engine, 0)
    for name, param in reference.named_parameters():
        param.grad = torch.full_like(param, 0.25)
        ds.safe_set_full_grad(params[name], param.grad)
        torch.testing.assert_close(ds.safe_get_full_grad(params[name]), param.grad, rtol=0, atol=0)
    optimizer.step()
    engine.step()
    state = engine.module_state_dict()  # what this rank's model holds (every rank runs this)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), param.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(state[name], param.detach(), rtol=0, atol=1e-6)
    name = "0.weight"
    value = torch.arange(params[name].numel(), dtype=torch.float32).view(params[name].shape)
    ds.safe_set_full_fp32_param(params[name], value)
    torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), value, rtol=0, atol=0)
    torch.testing.assert_close(engine.module_state_dict()[name], value, rtol=0, atol=0)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2])
@distributed_test(world_size=2)
def test_whole_writes_reach_every_rank_under_bf16(stage):
    """Whole optimizer states, fp32 values and gradients written, then a step: every rank's model
    is the one-process AdamW's (stage 0 steps whole buckets on every rank: no slice may stay stale)."""
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage, bf16={"enabled": True}))
    params = dict(engine.module.named_parameters())
    _micro_step(engine, 0)
    engine.step()
    reference = make_mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for name, param in reference.named_parameters():
        value = torch.linspace(-1, 1, param.numel()).view(param.shape)
        ds.safe_set_full_fp32_param(params[name], value)
        ds.safe_set_full_optimizer_state(params[name], torch.full_like(value, 0.1), "exp_avg")
        ds.safe_set_full_optimizer_state(params[name], torch.full_like(value, 0.01), "exp_avg_sq")
        with torch.no_grad():
            param.copy_(value)
        optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(value, 0.1),
                                  "exp_avg_sq": torch.full_like(value, 0.01)}
    _micro_step(engine, 1)
    for name, param in reference.named_parameters():
        param.grad = torch.full_like(param, 0.25)
        ds.safe_set_full_grad(params[name], param.grad.bfloat16())
    optimizer.step()
    engine.step()
    state = engine.module_state_dict()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), param.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(state[name].float(), param.detach().bfloat16().float(), rtol=0, atol=1e-2)
    engine.destroy()


@distributed_test(world_size=2)
def test_fp64_whole_reads_at_stage_1():
    """A rank owning none of a parameter allocates the result in the group's dtype (fp64 here)."""
    engine, _, _, _ = zerodist.initialize(model=make_mlp().double(), config=base_config(1))
    rank = comm.get_rank()
    x, y = global_batch(0, ROWS * 2)
    engine.backward(F.mse_loss(engine(x[rank * ROWS:(rank + 1) * ROWS].double()),
                               y[rank * ROWS:(rank + 1) * ROWS].double()))
    engine.step()
    for param in engine.module.parameters():
        value = ds.safe_get_full_fp32_param(param)
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, param.detach(), rtol=0, atol=0)
    engine.destroy()


@distributed_test(world_size=2)
def test_bad_input_raises_on_every_rank():
    """Each mistake made on rank 0 only: the same named error on both ranks, never a hang."""
    engine = _engine(1)
    rank = comm.get_rank()
    param = next(iter(engine.module.parameters()))
    stranger = torch.nn.Parameter(torch.zeros_like(param))
    with pytest.raises(ds.AccessorError, match="trained by zerodist on ranks \\[1\\]"):
        ds.safe_get_full_fp32_param(stranger if rank == 0 else param)
    with pytest.raises(KeyError, match="no optimizer state 'exp_avg'"):
        ds.safe_set_full_optimizer_state(param, torch.zeros_like(param), "exp_avg")
    local = ds.safe_get_local_fp32_param(param)
    with pytest.raises(ds.AccessorError, match="rank 0: the value has"):
        ds.safe_set_local_fp32_param(param, torch.cat([local, local.new_zeros(1)]) if rank == 0 else local)
    with pytest.raises(ds.AccessorError, match="rank 0: the value has"):
        ds.safe_set_full_fp32_param(param, torch.zeros(param.numel() + 1) if rank == 0 else torch.zeros_like(param))
    engine.destroy()


@distributed_test(world_size=2)
def test_bad_input_raises_on_every_rank_with_two_live_engines():
    """Two engines alive (TRL's policy and reference model): a rank that passes a parameter neither
    trains still joins the agreement (it used to return None alone while the other waited: a hang),
    and the ranks passing different parameters of the same size is named."""
    first, second = _engine(1), _engine(2)
    rank = comm.get_rank()
    for engine in (first, second):
        param = next(iter(engine.module.parameters()))
        stranger = torch.nn.Parameter(torch.zeros_like(param))
        with pytest.raises(ds.AccessorError, match="trained by zerodist on ranks \\[1\\]"):
            ds.safe_get_full_fp32_param(stranger if rank == 0 else param)
        with pytest.raises(ds.AccessorError, match="trained by zerodist on ranks \\[0\\]"):
            ds.safe_get_local_fp32_param(stranger if rank == 1 else param)
    mine, theirs = (next(iter(e.module.parameters())) for e in (first, second))
    with pytest.raises(ds.AccessorError, match="different parameters"):
        ds.safe_get_full_fp32_param(mine if rank == 0 else theirs)
    assert ds.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(3))) is None  # a stranger everywhere
    torch.testing.assert_close(ds.safe_get_full_fp32_param(theirs), theirs.detach(), rtol=0, atol=0)
    second.destroy()
    first.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2])
@distributed_test(world_size=2)
def test_gradients_only_between_a_reducing_backward_and_the_step(stage):
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=base_config(stage, gradient_accumulation_steps=2))
    param = next(iter(engine.module.parameters()))
    with pytest.raises(RuntimeError, match="only available immediately after backward"):
        ds.safe_get_full_grad(param)
    _micro_step(engine, 0)  # not the boundary: stages 0/1 have not reduced, stages 2/3 have (accumulating)
    if stage < 2:
        with pytest.raises(RuntimeError, match="not at a gradient accumulation boundary"):
            ds.safe_get_full_grad(param)
    else:
        assert ds.safe_get_full_grad(param).shape == param.shape
    engine.step()
    _micro_step(engine, 1)
    assert ds.safe_get_full_grad(param).shape == param.shape
    engine.step()
    with pytest.raises(RuntimeError, match="only available immediately after backward"):
        ds.safe_set_full_grad(param, torch.zeros_like(param))
    engine.destroy()


def _first_weight_frozen():  # type: ignore[no-untyped-def]
    """An engine over the MLP whose first weight is not trained (requires_grad off before initialize)."""
    model = make_mlp()
    model[0].weight.requires_grad_(False)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(1))
    return model, engine


@distributed_test(world_size=1)
def test_update_full_grad_vectorized_skips_parameters_not_trained():
    model, engine = _first_weight_frozen()
    _micro_step(engine, 0)
    seen = []

    def update(old, param):
        seen.append(param)
        return old * 2

    ds.safe_update_full_grad_vectorized(list(model.parameters()), update)
    assert all(p is not model[0].weight for p in seen) and len(seen) == len(list(model.parameters())) - 1
    engine.destroy()


@distributed_test(world_size=1)
def test_a_parameter_not_trained_gives_none():
    model, engine = _first_weight_frozen()
    assert ds.safe_get_full_fp32_param(model[0].weight) is None
    assert ds.safe_get_full_grad(torch.nn.Parameter(torch.zeros(2))) is None
    engine.destroy()


# ---------------------------------------------------------------- engine.coalesce_grad_reduction()

@pytest.mark.parametrize("stage", [1, 3])
@distributed_test(world_size=2)
def test_coalesce_grad_reduction_gives_the_steps_result(stage):
    """Four backward calls inside the block, then one step: bitwise the parameters of the same four
    calls without the block (DeepSpeed's own test compares the same two runs).
    test_coalesce_grad_reduction.py leaves the boundary alone and compares with one process."""
    results = []
    for coalesce in (False, True):
        engine = _engine(stage)
        block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
        with block:
            for chunk in range(4):
                engine.set_gradient_accumulation_boundary(chunk == 3)
                _micro_step(engine, chunk)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        results.append(engine.module_state_dict())
        engine.destroy()
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=0, atol=0)


@distributed_test(world_size=1)
def test_coalesce_grad_reduction_refuses_stage_0_and_nesting():
    engine = _engine(0)
    with pytest.raises(NotImplementedError, match="stage 1/2/3"):
        with engine.coalesce_grad_reduction():
            pass
    engine.destroy()
    engine = _engine(1)
    with engine.no_sync(), pytest.raises(AssertionError, match="nested"):
        with engine.coalesce_grad_reduction():
            pass
    engine.destroy()


# ---------------------------------------------------------------- gradient_allreduce_op

@pytest.mark.unit
def test_gradient_allreduce_op_mean_loads_and_sum_is_refused_even_under_warn(monkeypatch):
    """DeepSpeed's "sum" changes the gradients: it must never be dropped as an unknown key would be."""
    from zerodist.config import Config, ConfigError

    Config.load({"gradient_allreduce_op": "mean"})
    monkeypatch.setenv("ZERODIST_UNKNOWN_KEYS", "warn")
    with pytest.raises(ConfigError, match="'gradient_allreduce_op'.*\"mean\""):
        Config.load({"gradient_allreduce_op": "sum"})


@pytest.mark.unit
def test_gradient_allreduce_op_is_read_in_any_case_as_deepspeed_lowercases_it():
    from zerodist.config import Config, ConfigError

    for mean in ("MEAN", "Mean", "mean"):
        Config.load({"gradient_allreduce_op": mean})
    for refused in ("SUM", "Sum", "meanx", 1):
        with pytest.raises(ConfigError, match="'gradient_allreduce_op'.*any case"):
            Config.load({"gradient_allreduce_op": refused})
