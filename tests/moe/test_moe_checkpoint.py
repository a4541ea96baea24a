"""MoE checkpoints across expert-parallel sizes: saved at ep=2 on 2 ranks, loaded at ep=1 on 1 and
2 ranks and back; weights, fp32 masters and Adam moments carry over (the resumed run equals an
uninterrupted one-process run), the loaded weights equal the saved ones bitwise."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.engine_helpers import assert_close_relative, base_config
from tests.harness import run_distributed
from tests.moe.test_moe_engine import MICRO, MoEModel, _batch, _reference

pytestmark = pytest.mark.multiprocess

SAVE_AT, TOTAL = 3, 5
# Random second-expert choice and Jitter: keyed by (step, micro-batch index in the global batch),
# the routing continues after a resume, at any world and expert-parallel size.
OPTIONS = dict(k=2, drop_tokens=True, capacity_factor=0.75, min_capacity=0, top2_2nd_expert_sampling=True,
               noisy_gate_policy="Jitter")


def _engine(ep_size: int, stage: int, scramble: bool):
    model = MoEModel(ep_size, comm.get_rank() % ep_size, **OPTIONS)
    if scramble:  # the checkpoint must replace every value
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-1, 1)
    config = base_config(stage, train_batch_size=2 * MICRO, train_micro_batch_size_per_gpu=MICRO,
                         gradient_accumulation_steps=None)
    engine, *_ = zerodist.initialize(model=model, config=config)
    return engine


def _train(engine, stop: int) -> None:
    n, rank, gas = engine.topology.num_batch_shards, engine.topology.batch_rank, engine.batch.gradient_accumulation_steps
    for step in range(engine.global_steps, stop):
        for micro in range(gas):
            engine.backward(engine(*_batch(step, micro * n + rank)))
            engine.step()


def save_body(save_dir: str, ep_size: int, stage: int) -> dict[str, torch.Tensor]:
    engine = _engine(ep_size, stage, scramble=False)
    _train(engine, SAVE_AT)
    engine.save_checkpoint(save_dir)
    return engine.module_state_dict()


def load_body(save_dir: str, ep_size: int, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    engine = _engine(ep_size, stage, scramble=True)
    engine.load_checkpoint(save_dir)
    loaded = engine.module_state_dict()
    _train(engine, TOTAL)
    return loaded, engine.module_state_dict()


@pytest.mark.parametrize("saved, loaded", [
    ((2, 2, 2), (2, 2, 2)),
    ((1, 1, 0), (1, 1, 0)),
    ((2, 2, 2), (1, 1, 0)),   # (world, ep_size, stage): ep=2 -> one process
    ((2, 2, 2), (2, 1, 3)),   # ep=2 -> data=2 at ep=1, stage 3
    ((1, 1, 1), (2, 2, 2)),   # one process -> ep=2
    ((2, 1, 0), (2, 2, 3)),   # data=2 -> ep=2, stage 3
])
def test_checkpoint_reshards_across_expert_parallel_sizes(tmp_path, saved, loaded):
    (save_world, save_ep, save_stage), (load_world, load_ep, load_stage) = saved, loaded
    at_save = run_distributed(save_body, save_world, str(tmp_path), save_ep, save_stage)[0]
    loaded_state, final = run_distributed(load_body, load_world, str(tmp_path), load_ep, load_stage)[0]
    for key, value in at_save.items():
        assert torch.equal(loaded_state[key], value), key
    # Offline, without processes: the consolidated weights are the full model under global expert ids.
    consolidated = ckpt.consolidate_checkpoint(tmp_path)
    assert consolidated.keys() == at_save.keys()
    assert all(torch.equal(consolidated[k], v) for k, v in at_save.items())
    assert_close_relative(final, _reference(2, OPTIONS, steps=TOTAL), 1e-6)
