"""What the GPU tier's tests run on a rank (tests/gpu/test_gpu_tier.py): ZeRO at one rank on the
rank's device, and the same training as a plain loop, on the same device."""

from __future__ import annotations

from typing import Any

import torch

from zerodist.models.toy import make_mlp

STEPS, MICRO, IN, HIDDEN, OUT = 5, 4, 32, 64, 8


def config(stage: int, *, offload: bool = False, bf16: bool = False) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": section}


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(MICRO, IN, generator=generator), torch.randn(MICRO, OUT, generator=generator)
    return x.to(device), y.to(device)


def train_zero(stage: int, *, offload: bool = False, bf16: bool = False) -> dict[str, Any]:
    """STEPS steps of ZeRO `stage` on this rank's device: backend, devices, losses, parameters (on the CPU)."""
    import zerodist
    import zerodist.comm as comm

    engine, *_ = zerodist.initialize(model=make_mlp(IN, HIDDEN, OUT, seed=0), config=config(stage, offload=offload,
                                                                                            bf16=bf16))
    device = comm.device_for_rank()
    losses = []
    for step in range(STEPS):
        x, y = batch(step, device)
        loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16) if bf16 else x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    devices = sorted({str(p.device) for p in engine.module.parameters()})
    result = {"backend": comm.ensure_initialized().backend, "devices": devices, "losses": losses,
              "optimizer": type(engine.zero_state.inner_optimizer).__mro__[1].__name__,
              "params": {k: v.detach().float().cpu() for k, v in engine.module_state_dict().items()}}
    engine.destroy()
    return result


def train_plain(device: torch.device) -> dict[str, Any]:
    """The same training as a plain loop (torch's AdamW, no zerodist) on `device`."""
    model = make_mlp(IN, HIDDEN, OUT, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
