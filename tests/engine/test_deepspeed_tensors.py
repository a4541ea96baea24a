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
    for name, param in reference.named_parameters():
        torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), param.detach(), rtol=0, atol=1e-6)
    name = "0.weight"
    value = torch.arange(params[name].numel(), dtype=torch.float32).view(params[name].shape)
    ds.safe_set_full_fp32_param(params[name], value)
    torch.testing.assert_close(ds.safe_get_full_fp32_param(params[name]), value, rtol=0, atol=0)
    torch.testing.assert_close(engine.module_state_dict()[name], value, rtol=0, atol=0)
    engine.destroy()


@distributed_test(world_size=1)
def test_a_parameter_not_trained_gives_none():
    model = make_mlp()
    model[0].weight.requires_grad_(False)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(1))
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
