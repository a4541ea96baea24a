"""The demo GPT as pipeline layers, its token embedding tied to the head across the first and last
stage ([Note: tied gradients] in zerodist/pipe/tied.py), against the same layers in one process."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from zerodist.models import GPTConfig
from zerodist.models.gpt_pipe import gpt_loss, gpt_pipeline_layers
from zerodist.pipe import PipelineModule

CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
MICRO, GAS, STEPS = 2, 4, 3


def micro_batch(step: int, micro: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (MICRO, CONFIG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def module(num_stages: int, **placement) -> PipelineModule:
    return PipelineModule(gpt_pipeline_layers(CONFIG), num_stages=num_stages, loss_fn=gpt_loss, seed_layers=True,
                          partition_method="type:block|embeddings", **placement)


def reference_body(data: int, clip: float = 0.0):
    """One process: the whole pipeline module (one stage), gradient accumulation, torch's SGD
    (after torch's clip_grad_norm_ when `clip`: the tied module's parameters counted once)."""
    model = module(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states, losses, norms = [], [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            parts = [micro_batch(step, micro, d) for d in range(data)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = gpt_loss(model(x), y)
            (loss / GAS).backward()
            total += loss.item()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses, states, norms


def pipeline_body(stage: int, tensor: int = 1, clip: float = 0.0, schedule: str = "1f1b"):
    v = schedule in ("zbv", "dualpipev")
    model = module(2, **({"stages_per_rank": 2, "stage_placement": "v"} if v else {}))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": stage}, "zerodist": {"pipeline": {"schedule": schedule}}}
    if tensor > 1:
        config["tensor_parallel"] = {"autotp_size": tensor}
    if clip:
        config["gradient_clipping"] = clip
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    data_rank = engine.topology.axis_rank("data")
    losses, states, norms = [], [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter([micro_batch(step, m, data_rank) for m in range(GAS)])).item())
        states.append(engine.module_state_dict())
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return losses, states, model.local_stages, model.parts, norms


def check_against_reference(world: int, stage: int, tensor: int = 1, clip: float = 0.0,
                            schedule: str = "1f1b") -> list[float]:
    """Every rank's losses and parameters equal one process's; the reference's gradient norms."""
    data = world // 2 // tensor
    (ref_losses, ref_states, ref_norms), = run_distributed(reference_body, 1, data, clip)
    results = run_distributed(pipeline_body, world, stage, tensor, clip, schedule)
    if schedule == "1f1b":
        assert results[0][3] == [0, 2, 5]  # embeddings + a block | a block + LayerNorm + head
    keys = set()
    for losses, states, _, _, norms in results:
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        if clip:
            assert norms == pytest.approx(ref_norms, rel=1e-5)  # the tied module counted once, not per stage
        for step, state in enumerate(states):
            for key, value in state.items():
                keys.add(key)
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=1e-6), (step, key)
    assert keys == set(ref_states[0])
    assert "0.tok_emb.weight" in keys and "4.tok_emb.weight" in keys  # the tied copies, both trained alike
    return ref_norms


# pipe x tensor is tests/pipe/test_pipeline_engine.py::test_pipe2_tensor2 (an MLP with layer_specs): the
# built-in GPT plan names GPT's own modules, not these pipeline layers.
@pytest.mark.parametrize("world,stage,tensor", [(2, 1, 1), (4, 2, 1)])
def test_gpt_tied_embedding_across_two_stages(world, stage, tensor):
    check_against_reference(world, stage, tensor)


CLIP = 0.05  # below every step's gradient norm: every step is clipped


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 2)])
def test_gpt_tied_embedding_with_gradient_clipping(world, stage):
    # The tied embedding is on both stages, but the norm counts it once (on the tie group's first
    # stage, [Note: tied gradients]): clipping equals one process's clip_grad_norm_.
    ref_norms = check_against_reference(world, stage, clip=CLIP)
    assert min(ref_norms) > CLIP


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_tied_embedding_on_one_rank_of_a_v(schedule, stage):
    # In a V, rank 0 holds the first and the last stage: the tied embedding is one module there, written
    # by both stages' backwards. Its bucket is reduced once both are done (a stage's REDUCE_GRAD reduced
    # it after the head's and lost the embedding's later gradients), at data 2.
    check_against_reference(4, stage, schedule=schedule)
