"""A pipeline whose stages all sit on one rank (pipe degree 1, two stages per rank), run through
`initialize` and `train_batch` on the rank's device, and the same training as one plain loop of
gradient accumulation on that device: the body of tests/pipe/test_one_rank_pipeline.py (gloo, CPU)
and of the GPU tier's one-device pipeline (tests/gpu/test_gpu_tier.py, NCCL, cuda:0). The stages
exchange no message ([Note: p2p on NCCL] in zerodist/comm/p2p.py), the micro-batches are CPU
tensors (the executor moves them to the device)."""

from __future__ import annotations

from typing import Any

import torch

WIDTH, LAYERS, MICRO, GAS, STEPS = 8, 6, 4, 4, 3


def _layers(dtype: torch.dtype, device: torch.device) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                     for _ in range(LAYERS - 1)]
    return [layer.to(dtype=dtype, device=device) for layer in [*layers, torch.nn.Linear(WIDTH, WIDTH)]]


def _micro_batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(MICRO, WIDTH, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(MICRO, WIDTH, generator=g, dtype=torch.float64).to(dtype))


def one_rank_pipeline(schedule: str, dtype_name: str) -> dict[str, Any]:
    """STEPS steps of `schedule` over 2 stages on this rank, and of the plain loop: backend, the
    parameters' devices, both runs' losses and final parameters (on the CPU)."""
    import zerodist
    import zerodist.comm as comm
    from zerodist.pipe import PipelineModule

    dtype = getattr(torch, dtype_name)
    device = comm.device_for_rank()
    placement = "v" if schedule in ("zbv", "dualpipev") else "loop"
    module = PipelineModule(_layers(dtype, device), num_stages=1, stages_per_rank=2, stage_placement=placement,
                            loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
              "zerodist": {"pipeline": {"schedule": schedule}}}
    engine, _, _, _ = zerodist.initialize(model=module, config=config)
    losses = [float(engine.train_batch(iter([_micro_batch(step, j, dtype) for j in range(GAS)])))
              for step in range(STEPS)]
    result = {"backend": comm.ensure_initialized().backend,
              "devices": sorted({str(p.device) for p in engine.module.parameters()}), "losses": losses,
              "params": {k: v.detach().cpu() for k, v in engine.module_state_dict().items()}}
    engine.destroy()
    result["plain"] = _plain(dtype, device)
    return result


def _plain(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    model = torch.nn.Sequential(*_layers(dtype, device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for j in range(GAS):
            x, y = (t.to(device) for t in _micro_batch(step, j, dtype))
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / GAS).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
    return {"losses": losses, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def check(result: dict[str, Any], dtype_name: str) -> None:
    """The pipeline's losses and parameters equal the plain loop's (1e-6, fp64 1e-12)."""
    tolerance = 1e-12 if dtype_name == "float64" else 1e-6
    plain = result["plain"]
    assert result["losses"] == __import__("pytest").approx(plain["losses"], rel=tolerance, abs=tolerance)
    assert set(result["params"]) == set(plain["params"]), "the stages' state-dict keys are nn.Sequential's"
    for key, value in plain["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=0, atol=tolerance, msg=key)
