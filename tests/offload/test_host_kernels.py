"""Which kernels the host step takes ([Note: the host step's kernels] in zerodist/offload/host.py): torch's
fused CPU kernel from a real accelerator, foreach under the simulated device, the user's choice always."""

from __future__ import annotations

import pytest
import torch

from zerodist.offload.host import prefer_host_kernels

pytestmark = pytest.mark.unit


def _params() -> list[torch.Tensor]:
    return [torch.zeros(8, requires_grad=True)]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_fused_from_an_accelerator_foreach_from_the_simulated_device(cls):
    from_gpu, simulated = cls(_params(), lr=0.1), cls(_params(), lr=0.1)
    prefer_host_kernels(from_gpu, torch.device("cuda", 0))
    prefer_host_kernels(simulated, torch.device("cpu"))
    assert (from_gpu.param_groups[0]["fused"], from_gpu.param_groups[0]["foreach"]) == (True, False)
    assert (simulated.param_groups[0]["fused"], simulated.param_groups[0]["foreach"]) in {(None, True), (False, True)}


def test_the_users_choice_stays_and_an_optimizer_without_a_cpu_kernel_takes_foreach():
    chose_foreach = torch.optim.AdamW(_params(), foreach=False)
    prefer_host_kernels(chose_foreach, torch.device("cuda", 0))
    assert (chose_foreach.param_groups[0]["foreach"], chose_foreach.param_groups[0]["fused"]) == (False, None)
    no_cpu_kernel = torch.optim.RMSprop(_params())
    prefer_host_kernels(no_cpu_kernel, torch.device("cuda", 0))
    assert no_cpu_kernel.param_groups[0]["foreach"] is True


def test_the_fused_cpu_adamw_follows_foreach_within_1e6():
    """What the choice costs in arithmetic: the fused CPU kernel against the foreach one it replaces,
    20 steps of 10,000 elements."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(10_000, generator=generator)
    grads = [torch.randn(10_000, generator=generator) for _ in range(20)]
    results = []
    for fused in (True, False):
        param = start.clone().requires_grad_()
        optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=fused, foreach=not fused)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        results.append(param.detach())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)
