"""The GPU tier (docs/gpu.md): ZeRO 0-3 at one rank on NCCL against a plain loop, bf16, host offload
against in-device training, a pipeline on one device, and the allocation check on the GPU. Every
test is marked `gpu` and skipped without CUDA (tests/gpu/conftest.py); `python -m benchmarks.gpu_tier`
runs them and the one-rank overhead benchmark. None of them has run on a GPU yet."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_runs import STEPS, train_plain, train_zero
from tests.harness import run_distributed

pytestmark = pytest.mark.gpu


def _zero_and_plain(stage: int) -> dict:
    import zerodist.comm as comm

    return {"zero": train_zero(stage), "plain": train_plain(comm.device_for_rank())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_at_one_rank_on_nccl_matches_a_plain_loop(stage):
    result = run_distributed(_zero_and_plain, 1, stage, timeout=180, backend="nccl")[0]
    zero, plain = result["zero"], result["plain"]
    assert zero["backend"] == "nccl" and zero["devices"] == ["cuda:0"], (zero["backend"], zero["devices"])
    for key, value in plain["params"].items():
        torch.testing.assert_close(zero["params"][key], value, rtol=0, atol=1e-6, msg=key)
    assert zero["losses"] == pytest.approx(plain["losses"], abs=1e-6)


def _bf16_and_plain(stage: int) -> dict:
    import zerodist.comm as comm

    return {"zero": train_zero(stage, bf16=True), "plain": train_plain(comm.device_for_rank())}


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_at_one_rank_on_nccl_follows_the_fp32_plain_loop(stage):
    """bf16 parameters and gradients with fp32 masters track the fp32 plain loop: on the CPU the losses
    agree within 1.2e-4 relative and the parameters within 3e-3 (each step draws a new batch, so the loss
    need not fall in 5 steps)."""
    result = run_distributed(_bf16_and_plain, 1, stage, timeout=180, backend="nccl")[0]
    zero, plain = result["zero"], result["plain"]
    assert zero["backend"] == "nccl" and zero["devices"] == ["cuda:0"]
    assert zero["losses"] == pytest.approx(plain["losses"], rel=1e-2)
    for key, value in plain["params"].items():
        torch.testing.assert_close(zero["params"][key], value, rtol=0, atol=2e-2, msg=key)


def _offload_and_in_device(stage: int) -> dict:
    return {"offload": train_zero(stage, offload=True), "device": train_zero(stage)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_offload_matches_in_device_training(stage):
    """The host's AdamW (CPU kernels) against the GPU's: equal within 1e-6; bitwise where the kernels round
    alike (the CPU run of tests/offload/test_host_offload.py is bitwise; `benchmarks.gpu_tier` reports
    whether this one is)."""
    result = run_distributed(_offload_and_in_device, 1, stage, timeout=180, backend="nccl")[0]
    offload, device = result["offload"], result["device"]
    assert offload["optimizer"] == "HostOffloadedOptimizer" and offload["devices"] == ["cuda:0"]
    for key, value in device["params"].items():
        torch.testing.assert_close(offload["params"][key], value, rtol=0, atol=1e-6, msg=key)
    assert len(offload["losses"]) == STEPS


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_pipeline_on_one_device(schedule):
    """Two pipeline stages on the one rank's GPU (NCCL; they exchange no message) against one plain loop of
    gradient accumulation on the same GPU, within 1e-6 (tests/pipe/one_rank_pipeline.py; its gloo run is
    tests/pipe/test_one_rank_pipeline.py). Pipelines across ranks on NCCL are refused ([Note: p2p on NCCL])."""
    from tests.pipe.one_rank_pipeline import check, one_rank_pipeline

    result = run_distributed(one_rank_pipeline, 1, schedule, "float32", timeout=180, backend="nccl")[0]
    assert result["backend"] == "nccl" and result["devices"] == ["cuda:0"], (result["backend"], result["devices"])
    check(result, "float32")


def test_every_allocation_follows_the_parameters_device_on_cuda():
    from tests.gpu.test_allocations import _run

    for stage in (0, 1, 2, 3):
        result = run_distributed(_run, 1, stage, stage in (1, 2), "cuda", timeout=180, backend="nccl")[0]
        assert result["deviceless"] == {}, (stage, result["deviceless"])
        assert result["wrong_device"] == {}, (stage, result["wrong_device"])
