"""Hugging Face models fine-tuned in part at ZeRO-3, as PEFT and LLaMA-Factory's `freeze` tuning
leave them: most weights frozen, built under `zerodist.zero.Init()`, with transformers' gradient
checkpointing (reentrant, inputs made to require grad, as PEFT does). The frozen weights are sharded
([Note: frozen parameters at stage 3] in zerodist/zero/apply.py) and the run equals one process's."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config
from tests.harness import distributed_test
from tests.hf_models import hf_batch, hf_class, hf_config, hf_loss
from zerodist.zero import Init, is_sharded

pytest.importorskip("transformers")

CONFIG = base_config(3, optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                     zero_optimization={"stage3_param_persistence_threshold": 0})
TRAINED = {"llama": ("self_attn.o_proj.weight", "mlp.down_proj.weight"), "gpt2": ("attn.c_proj.weight", "mlp.c_proj.weight")}


def _prepare(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(TRAINED[kind]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    return model.train()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@distributed_test(world_size=2)
def test_partial_fine_tuning_shards_the_frozen_weights_and_trains_like_one_process(kind):
    config = hf_config(kind)
    torch.manual_seed(5)
    reference = _prepare(hf_class(kind)(config), kind)
    torch.manual_seed(5)
    with Init():
        model = hf_class(kind)(config)
    engine, _, _, _ = zerodist.initialize(model=_prepare(model, kind), config=CONFIG)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    state = engine.zero_state
    assert state.frozen_groups and all(is_sharded(p) for p in frozen) and model.is_gradient_checkpointing
    whole = sum(p.numel() for p in frozen)
    held = sum(g.param_shard.numel() for g in state.frozen_groups)
    assert held <= whole / 2 + 2 * 64 * len(state.frozen_groups)  # half, and each bucket's padding

    n, rank, micro = comm.get_world_size(), comm.get_rank(), engine.batch.micro_batch_size
    trained = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.1, momentum=0.9)
    for step in range(4):
        ids = hf_batch(step, micro * n)
        loss = hf_loss(engine, ids[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        optimizer.zero_grad()
        expected = hf_loss(reference, ids)
        expected.backward()
        optimizer.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / n, expected.detach(), rtol=1e-6, atol=1e-6)
    final = engine.module_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-6, msg=key)
    engine.destroy()
