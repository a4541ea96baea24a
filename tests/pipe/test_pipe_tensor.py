"""Pipe x tensor on `split_model`: each stage of a model cut by `split_model` is tensor-parallel by
the model's own plan (its names are the model's: [Note: split keeps the names] in
zerodist/pipe/split.py), and the stages pass the replicated hidden states. pipe 2 x tensor 2 on 4
gloo ranks, ZeRO 1 and 3, 5 steps of SGD: parameters within 1e-6 of the unsplit model in one
process doing gradient accumulation over the same micro-batches. Hugging Face GPT-2 (Conv1D, its
head tied to `wte` across the stages) too: the tie holds on the vocab-parallel slices ([Note: tied
slices] in zerodist/pipe/apply.py). (Pipe x tensor on a
`PipelineModule` with a DeepSpeed plan: tests/pipe/test_pipeline_engine.py.)"""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, STEPS, build, config, micro_batch, reference_body
from zerodist.pipe import split_model

pytestmark = pytest.mark.slow


def pipe_tensor_body(family: str, stage: int, split_points: list[str] | None):
    module = split_model(build(family), num_stages=2, split_points=split_points)
    settings = config(stage)
    settings["tensor_parallel"] = {"autotp_size": 2}
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    assert engine.topology.degrees["tensor"] == 2 and engine.topology.degrees["pipe"] == 2
    sliced = engine.part_states["tensor"].report()
    losses, states = [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter([micro_batch(step, m, 0) for m in range(GAS)])).item())
        states.append(engine.module_state_dict())  # the logical model's names and shapes
    engine.destroy()
    return losses, states, sliced


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("family, split_points", [("gpt-untied", None), ("llama-kv2", ["model.layers.1"]),
                                                  ("gpt2", None)])
def test_split_model_pipe2_tensor2_equals_one_process(family, split_points, stage):
    (ref_losses, ref_states), = run_distributed(reference_body, 1, family, 1)
    results = run_distributed(pipe_tensor_body, 4, family, stage, split_points, timeout=240)
    for losses, states, sliced in results:
        assert sliced and sliced[0].startswith("tensor parallel: degree 2")
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for step, state in enumerate(states):
            for key, value in state.items():
                assert value.shape == ref_states[step][key].shape, key
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=1e-6), (family, step, key)


def tied_refused_body():
    module = split_model(build("gpt"), num_stages=2)  # the head tied to the vocab-parallel embedding
    settings = config(1)
    settings["tensor_parallel"] = {"autotp_size": 2}
    try:
        zerodist.initialize(model=module, config=settings)
    except Exception as error:  # noqa: BLE001 - the test reads its type and message
        return type(error).__name__, str(error)
    return None


def test_a_tied_head_that_the_plan_slices_is_refused_by_name_on_every_rank():
    for result in run_distributed(tied_refused_body, 4, timeout=120):
        # the plan's own tie check on the whole model (the head shares the embedding the demo GPT's plan
        # would slice, with no TiedHead entry), on every stage's ranks alike
        assert result is not None and result[0] == "PlanError" and "tok_emb.weight" in result[1], result
