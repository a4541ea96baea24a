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
