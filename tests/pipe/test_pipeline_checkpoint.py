"""Pipeline checkpoints are keyed by logical layer names (a PipelineModule's keys are
nn.Sequential's), so they load at any pipe degree: save at pipe 2 x data 2, consolidate to the
unsplit model, load at pipe 1 (data 2) and pipe 4 with the optimizer state."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from tests.pipe.test_pipeline_engine import GAS, config, micro_batch, mlp_layers
from zerodist.pipe import PipelineModule


def body(path: str, pipe: int, load: bool, first_step: int, steps: int, save: bool):
    module = PipelineModule(mlp_layers(), num_stages=pipe, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1))
    if load:
        engine.load_checkpoint(path)
    data_rank = engine.topology.axis_rank("data")
    for step in range(first_step, first_step + steps):
        engine.train_batch(iter([micro_batch(step, micro, data_rank, torch.float32) for micro in range(GAS)]))
    if save:
        engine.save_checkpoint(path)
    state, steps_done = engine.module_state_dict(), engine.global_steps
    engine.destroy()
    return state, steps_done


@pytest.mark.slow  # three pools of ranks and a subprocess
def test_save_at_pipe2_data2_load_at_pipe1_and_pipe4(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(body, 4, path + "-unused", 2, False, 0, 4, False)
    run_distributed(body, 4, path, 2, False, 0, 2, True)
    full_file = str(tmp_path / "full.pt")
    subprocess.run([sys.executable, "-m", "zerodist", "checkpoint", "consolidate", path, full_file], check=True,
                   capture_output=True)
    full = torch.load(full_file)
    assert set(full) == set(torch.nn.Sequential(*mlp_layers()).state_dict())  # the unsplit model's keys
    for state, steps_done in run_distributed(body, 4, path, 4, True, 0, 0, False):  # pipe 4 x data 1
        assert steps_done == 2 and len(state) == 4
        assert all(torch.equal(value, full[key]) for key, value in state.items())
    # pipe 1 x data 2 (the same global batch): two more steps equal four uninterrupted ones
    expected = {k: v for state, _ in uninterrupted for k, v in state.items()}
    for state, steps_done in run_distributed(body, 2, path, 1, True, 2, 2, False):
        assert steps_done == 4 and set(state) == set(full)
        for key, value in state.items():
            assert torch.allclose(value, expected[key], rtol=0, atol=1e-6), key


def gpt_body(path: str, pipe: int, load: bool, first_step: int, steps: int, save: bool, stage: int = 1):
    """The demo GPT as pipeline layers, its head tied to the token embedding across the first and last
    stage ([Note: a tied module's first name] in zerodist/pipe/module.py)."""
    from tests.pipe.test_pipeline_gpt import CONFIG, GAS as GPT_GAS, micro_batch as gpt_micro_batch
    from zerodist.models.gpt_pipe import gpt_loss, gpt_pipeline_layers

    module = PipelineModule(gpt_pipeline_layers(CONFIG), num_stages=pipe, loss_fn=gpt_loss, seed_layers=True,
                            partition_method="uniform")
    engine, _, _, _ = zerodist.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GPT_GAS, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": stage}})
    if load:
        engine.load_checkpoint(path)
    data_rank = engine.topology.axis_rank("data")
    for step in range(first_step, first_step + steps):
        engine.train_batch(iter([gpt_micro_batch(step, micro, data_rank) for micro in range(GPT_GAS)]))
    if save:
        engine.save_checkpoint(path)
    names = [name for name, _ in module.named_parameters()]
    state, steps_done = engine.module_state_dict(), engine.global_steps
    engine.destroy()
    return state, steps_done, names


@pytest.mark.parametrize("stage", [1, 2])
def test_tied_gpt_saved_at_pipe2_data2_loads_at_pipe1_and_pipe4(tmp_path, stage):
    """The tied head is trained under the embedding's name on the last stage too, so the checkpoint holds
    it once (the two stages' data ranks cut it at different shard boundaries): pipe 1 x data 2 resumes
    to the uninterrupted run, and pipe 4 loads the saved values bitwise."""
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(gpt_body, 4, path + "-unused", 2, False, 0, 4, False, stage)
    saved = run_distributed(gpt_body, 4, path, 2, False, 0, 2, True, stage)
    assert all("4.tok_emb.weight" not in names and "0.tok_emb.weight" in names
               for _, _, names in saved[2:])  # the last stage names the tied module as one process does
    expected = {k: v for state, _, _ in uninterrupted for k, v in state.items()}
    for state, steps_done, _ in run_distributed(gpt_body, 2, path, 1, True, 2, 2, False, stage):  # pipe 1 x data 2
        assert steps_done == 4
        for key, value in state.items():
            assert torch.allclose(value, expected[key], rtol=0, atol=1e-6), key
    at_save = {k: v for state, _, _ in saved for k, v in state.items()}
    for state, steps_done, _ in run_distributed(gpt_body, 4, path, 4, True, 2, 0, False, stage):  # pipe 4 x data 1
        assert steps_done == 2
        assert all(torch.equal(value, at_save[key]) for key, value in state.items())
