"""Every allocation follows the parameters' device: ZeRO 0-3 on one rank, with the parameters on the
(simulated, [Note: a simulated device] in zerodist/accelerator.py) device, create no tensor in a
zerodist hot path without naming its device, and every flat buffer is on the parameters' device."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.allocations import DevicelessAllocations
from tests.harness import run_distributed
from zerodist.models.toy import make_mlp


def _flat_tensors(zero) -> dict[str, torch.Tensor]:
    found = {}
    for index, group in enumerate(zero.groups):
        for name in ("param_buffer", "param_shard", "grad_buffer", "grad_shard", "master"):
            value = getattr(group, name, None)
            if isinstance(value, torch.Tensor):
                found[f"{index}.{name}"] = value
        for position, tensor in enumerate(group.optimizer_tensors):
            found[f"{index}.optimizer_tensors[{position}]"] = tensor
    return found


def _run(stage: int, offload: bool, device: str) -> dict:
    import zerodist
    from zerodist.accelerator import simulated_device

    section: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        section["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": section}
    mode = DevicelessAllocations()
    with simulated_device(), mode:
        model = make_mlp(16, 32, 4, layers=3, seed=0).to(device)
        engine, *_ = zerodist.initialize(model=model, config=config)
        for step in range(2):
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(2, 16, generator=generator, device="cpu").to(device, torch.bfloat16)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        wrong = {name: str(t.device) for name, t in _flat_tensors(engine.zero_state).items()
                 if t.device != torch.device(device, 0) and t.device != torch.device(device)}
        engine.destroy()
    return {"deviceless": dict(mode.found), "wrong_device": wrong}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_allocation_follows_the_parameters_device(stage):
    result = run_distributed(_run, 1, stage, stage in (1, 2), "cpu", timeout=90)[0]
    assert result["deviceless"] == {}, f"allocations without a device in zerodist hot paths: {result['deviceless']}"
    assert result["wrong_device"] == {}
