"""MoE models built partitioned: `zero.Init` replays the expert copies' initialisation, so a
meta-built MoE GPT at ZeRO-3 starts from the eager build's values, at ep_size 1 and 2."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import distributed_test
from zerodist.models.moe_gpt import MoEConfig, moe_gpt


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


@distributed_test(world_size=[1, 2])
def test_moe_built_under_init_equals_the_eager_build(world_size):
    moe = MoEConfig(num_experts=4, ep_size=world_size)
    torch.manual_seed(0)
    eager, *_ = zerodist.initialize(model=moe_gpt("tiny", moe), config=_config())
    expected = eager.module_state_dict()
    torch.manual_seed(0)
    with zerodist.zero.Init():
        model = moe_gpt("tiny", moe)
    assert all(p.is_meta for p in model.parameters())
    built, *_ = zerodist.initialize(model=model, config=_config())
    got = built.module_state_dict()
    assert got.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, f"{len(differ)} tensors differ from the eager build, e.g. {differ[:3]}"
    assert any("deepspeed_experts.3." in k for k in got)  # every global expert, gathered under its global id
