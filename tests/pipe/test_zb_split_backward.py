"""The split backward (I then W) against one ordinary backward: the same input and weight
gradients, bitwise, and the weight pass runs no input-gradient work ([Note: split backward])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerodist.models.gpt import Block, GPTConfig
from zerodist.pipe.backward_split import input_backward, weight_backward

pytestmark = pytest.mark.unit

CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)


class _TwoUses(nn.Module):
    """A weight used twice on the input path, and a term that depends on parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.offset = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(self.linear(x))) + self.offset * self.offset


def _stage(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(Block(CONFIG), Block(CONFIG)) if kind == "blocks" else _TwoUses()
    return module.to(dtype)


def _grads(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, split: bool):
    module.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(True)
    out = module(leaf.clone())
    params = [p for p in module.parameters()]
    if split:
        (input_grad,), kept = input_backward([out], [grad], [leaf])
        assert all(p.grad is None for p in params), "the input pass writes no weight gradient"
        weight_backward(kept, params)
    else:
        out.backward(grad)
        input_grad = leaf.grad
    return input_grad, [p.grad.clone() for p in params]


@pytest.mark.parametrize("kind", ["blocks", "two_uses"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_backward_equals_one_backward_bitwise(kind, dtype):
    module = _stage(kind, dtype)
    shape = (3, CONFIG.seq_len, 16)
    x, grad = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    ref_input, ref_weights = _grads(module, x, grad, split=False)
    input_grad, weights = _grads(module, x, grad, split=True)
    assert torch.equal(input_grad, ref_input)
    for got, want in zip(weights, ref_weights):
        assert torch.equal(got, want)


def test_weight_pass_runs_no_input_gradient_matmul():
    # Each Linear's input-gradient mm runs once in I, its weight-gradient mm once in W: I + W do
    # the matmuls of one ordinary backward, not one and a half.
    module = _stage("blocks", torch.float32)
    x = torch.randn(2, CONFIG.seq_len, 16)
    out = module(x.requires_grad_(True).clone())
    grad = torch.randn_like(out)

    def count(fn) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))

    ordinary = count(lambda: torch.autograd.backward([out], [grad], retain_graph=True))
    module.zero_grad(set_to_none=True)
    kept = []
    i_count = count(lambda: kept.append(input_backward([out], [grad], [x])[1]))
    w_count = count(lambda: weight_backward(kept[0], list(module.parameters())))
    assert i_count + w_count == ordinary


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(CONFIG), Block(CONFIG)])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False])
def test_split_backward_under_activation_checkpointing(reentrant):
    # Non-reentrant: W recomputes what it unpacks; the gradients are one backward's, each counted
    # once. (torch refuses the reentrant checkpoint under autograd.grad: the engine refuses the
    # split schedules with it by name, tests/pipe/test_zb_v.py.)
    torch.manual_seed(0)
    module = _Checkpointed(reentrant).double()
    shape = (2, CONFIG.seq_len, 16)
    x, grad = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    ref_input, ref_weights = _grads(module, x, grad, split=False)
    module.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(True)
    out = module(leaf.clone())
    params = list(module.parameters())
    (input_grad,), kept = input_backward([out], [grad], [leaf])
    weight_backward(kept, params)
    assert torch.allclose(input_grad, ref_input, rtol=0, atol=1e-12)
    for param, want in zip(params, ref_weights):
        assert torch.allclose(param.grad, want, rtol=0, atol=1e-12)
