"""Host offload from an accelerator (`offload_optimizer: cpu` with parameters on a device), run on the
CPU through `zerodist.accelerator.simulated_device()`: the CPU counts as a device distinct from the
host, so the optimizer steps host copies and the gradients and values travel as they would from a
GPU. On 2 gloo ranks at ZeRO 1, 2 and 3 (fp32 and bf16), 5 AdamW steps give parameters and
optimizer state bitwise those of in-device training."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from zerodist.models.toy import make_mlp

STEPS, MICRO, IN, HIDDEN, OUT = 5, 4, 32, 64, 8


def _config(stage: int, offload: bool, bf16: bool) -> dict:
    section: dict = {"stage": stage}
    if offload:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": section}


def _train(stage: int, offload: bool, bf16: bool) -> dict:
    import zerodist
    from zerodist.accelerator import simulated_device
    from zerodist.offload import HostOffloadedOptimizer

    with simulated_device():
        model = make_mlp(IN, HIDDEN, OUT, layers=3, seed=0)
        engine, *_ = zerodist.initialize(model=model, config=_config(stage, offload, bf16))
        rank = engine.global_rank
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(MICRO, IN, generator=generator), torch.randn(MICRO, OUT, generator=generator)
            out = engine(x.to(torch.bfloat16 if bf16 else torch.float32)).float()
            engine.backward(torch.nn.functional.mse_loss(out, y))
            engine.step()
        zero = engine.zero_state
        inner = zero.inner_optimizer
        assert isinstance(inner, HostOffloadedOptimizer) == offload, type(inner)
        optimizer = {f"{g}.{i}": {k: v.clone() for k, v in inner.state[t].items()}
                     for g, group in enumerate(zero.groups) for i, t in enumerate(group.optimizer_tensors)}
        numel = sum(t.numel() for group in zero.groups for t in group.optimizer_tensors)
        result = {"params": engine.module_state_dict(), "optimizer": optimizer, "numel": numel,
                  "counters": vars(inner.counters).copy() if offload else None,
                  "state_bytes": zero.optimizer.state_bytes()}
        engine.destroy()
    return result


def _compare(stage: int, bf16: bool) -> dict:
    reference, offloaded = _train(stage, False, bf16), _train(stage, True, bf16)
    for key, value in reference["params"].items():
        assert torch.equal(offloaded["params"][key], value), key
    assert reference["optimizer"].keys() == offloaded["optimizer"].keys()
    for key, state in reference["optimizer"].items():
        for kind, value in state.items():
            assert torch.equal(offloaded["optimizer"][key][kind].to(value.device), value), (key, kind)
    return {"counters": offloaded["counters"], "numel": offloaded["numel"],
            "state_bytes": (reference["state_bytes"], offloaded["state_bytes"])}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_offload_is_bitwise_in_device_training(stage):
    for result in run_distributed(_compare, 2, stage, False, timeout=120):
        counters, numel = result["counters"], result["numel"]
        assert counters["steps"] == STEPS
        # Every step copies each stepped tensor's gradient out and its new values back (fp32: 4 bytes).
        assert counters["to_device"] == STEPS * numel * 4
        # The gradients and the values out (fp32: 4 bytes each), the values back.
        assert counters["to_host"] == STEPS * numel * 8
        reference_bytes, offloaded_bytes = result["state_bytes"]
        assert offloaded_bytes < reference_bytes  # Adam's two states left the device


def test_host_offload_bf16_is_bitwise_in_device_training():
    run_distributed(_compare, 2, 2, True, timeout=120)


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in (300, 1000, 7)]


def _steps(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for tensor in tensors:
            tensor.grad = torch.randn(tensor.numel(), generator=generator)
        optimizer.step()
        for tensor in tensors:
            tensor.grad = None


@pytest.mark.unit
def test_values_written_on_the_device_between_steps_reach_the_host_and_state_round_trips():
    from zerodist.accelerator import simulated_device
    from zerodist.offload import host_offloaded

    reference, offloaded = _tensors(0), _tensors(0)
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.01)
    with simulated_device():
        optimizer = host_offloaded(torch.optim.AdamW(offloaded, lr=1e-2, weight_decay=0.01), torch.device("cpu"),
                                   wave_numel=500)  # 3 tensors in 2 waves
        _steps(plain, reference, range(2))
        _steps(optimizer, offloaded, range(2))
        for tensor in (*reference, *offloaded):  # a checkpoint load or a modifier rank, on the device
            tensor.data.mul_(0.5)
        _steps(plain, reference, range(2, 4))
        _steps(optimizer, offloaded, range(2, 4))
        assert type(optimizer).__name__ == "AdamW" and optimizer.counters.steps == 4
        for a, b in zip(reference, offloaded):
            assert torch.equal(a, b)
        saved = optimizer.state_dict()
        again = host_offloaded(torch.optim.AdamW(offloaded, lr=1e-2, weight_decay=0.01), torch.device("cpu"))
        again.load_state_dict(saved)
        _steps(plain, reference, range(4, 6))
        _steps(again, offloaded, range(4, 6))
    for a, b in zip(reference, offloaded):
        assert torch.equal(a, b)
        assert torch.equal(plain.state[a]["exp_avg_sq"], again.state[b]["exp_avg_sq"])
