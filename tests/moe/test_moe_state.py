"""Expert state dicts with global ids (zerodist/moe/state.py): ep=2 -> ep=1 and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodist.comm as comm
from tests.harness import distributed_test
from zerodist.moe.layer import MoE
from zerodist.moe.state import gather_global_state_dict, localize_state_dict
from zerodist.moe.utils import is_moe_param

_TOPOLOGY: list[comm.Topology] = []


class _Model(nn.Module):
    """An MoE layer beside a dense parameter and a buffer whose names contain 'expert'."""

    def __init__(self, ep_size: int, num_experts: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.expert_bias = nn.Parameter(torch.linspace(-1, 1, 8))
        self.register_buffer("experts_mask", torch.tensor([1.0, 0.0, 1.0, 1.0]))
        self.moe = MoE(8, nn.Linear(8, 8), num_experts=num_experts, ep_size=ep_size, k=2, use_rts=False,
                       top2_2nd_expert_sampling=False)
        if ep_size > 1:
            if not _TOPOLOGY:
                _TOPOLOGY.append(comm.Topology(expert=2))
            self.moe.set_topology(_TOPOLOGY[0])
        with torch.no_grad():  # expert g's weights depend on g only, at any ep_size
            for local, global_id in enumerate(self.moe.global_expert_ids()):
                expert = self.moe.deepspeed_moe.experts.deepspeed_experts[local]
                generator = torch.Generator().manual_seed(10 + global_id)
                expert.weight.copy_(torch.randn(8, 8, generator=generator))

    def forward(self, x):
        output, _, _ = self.moe(x + self.expert_bias)
        return output * self.experts_mask.sum()


@distributed_test(world_size=2)
def test_ep2_state_loads_strictly_at_ep1_and_back():
    model = _Model(ep_size=2)
    rank = comm.get_rank()
    full = gather_global_state_dict(model, model.state_dict())
    assert "moe.deepspeed_moe.experts.deepspeed_experts.3.weight" in full
    assert torch.equal(full["expert_bias"], model.expert_bias.detach())
    assert torch.equal(full["experts_mask"], model.experts_mask)
    assert not is_moe_param(model.expert_bias)
    reference = _Model(ep_size=1)
    reference.load_state_dict(full, strict=True)
    assert all(torch.equal(v, full[k]) for k, v in reference.state_dict().items())  # ep=1 builds the same experts
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    assert torch.equal(model(x), reference(x))  # bitwise: see [Note: one call per block]
    fresh = _Model(ep_size=2)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    fresh.load_state_dict(localize_state_dict(fresh, full), strict=True)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


@pytest.mark.unit
def test_expert_count_mismatch_is_named():
    full = _Model(ep_size=1, num_experts=4).state_dict()
    with pytest.raises(ValueError, match=r"holds experts \[0, 1, 2, 3\] but the layer has num_experts=2"):
        localize_state_dict(_Model(ep_size=1, num_experts=2), full)
