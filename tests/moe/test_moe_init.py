"""MoE models built partitioned: `zero.Init` replays the expert copies' initialisation, so a
meta-built MoE GPT at ZeRO-3 starts from the eager build's values, at ep_size 1 and 2."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import zerodist
from tests.harness import distributed_test
from zerodist.models.moe_gpt import MoEConfig, moe_gpt

pytestmark = pytest.mark.multiprocess


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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@distributed_test(world_size=2)
def test_step_log_shows_each_moe_layers_load():
    """At every printed step the engine's log names each MoE layer's routes per expert, imbalance,
    drops and all-to-all elements (rank 0's last forward), as `zerodist train --moe` summarises."""
    torch.manual_seed(0)
    config = {**_config(), "steps_per_print": 1}
    engine, *_ = zerodist.initialize(model=moe_gpt("tiny", MoEConfig(num_experts=4, ep_size=2)), config=config)
    handler = _Lines()
    logging.getLogger("zerodist").addHandler(handler)
    try:
        tokens = torch.randint(0, 256, (2, 33))
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    finally:
        logging.getLogger("zerodist").removeHandler(handler)
    moe_lines = [line for line in handler.lines if "MoE 'blocks." in line]
    if zerodist.comm.get_rank() == 0:
        assert len(moe_lines) == len(engine.module.moe_layers()), handler.lines
        routes = [int(x) for x in moe_lines[0].split("routes per expert [")[1].split("]")[0].split(",")]
        assert len(routes) == 4 and sum(routes) == 2 * 32  # top-1: every token of the micro-batch routed once
        assert "imbalance" in moe_lines[0] and "all-to-all" in moe_lines[0]
    else:
        assert moe_lines == []


@distributed_test(world_size=2)
def test_a_stage_3_moe_engine_that_ran_backward_is_freed():
    """The stage-3 pre-backward hook lives on the outputs' autograd nodes, which MoE layers keep; it
    holds the runtime weakly, so a dropped engine (and its shards) is collected. Before, it stayed
    alive through a cycle via C++ autograd nodes that Python's collector cannot see."""
    from zerodist.zero import sharded_access

    gc.collect()
    before = sharded_access.num_registered()

    def train_one_step() -> None:
        engine, *_ = zerodist.initialize(model=moe_gpt("tiny", MoEConfig(num_experts=4, ep_size=2)), config=_config())
        tokens = torch.randint(0, 256, (2, 33))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        assert sharded_access.num_registered() > before

    train_one_step()
    gc.collect()
    assert sharded_access.num_registered() == before
