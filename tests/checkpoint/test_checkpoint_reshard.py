"""Checkpoints across world sizes and ZeRO stages, with no offline step.

Save at one (world size, stage), load at another, continue: the run matches the single-process
reference within fp32 rounding; the parameters and optimizer state carried over are exact
(saving again from the new layout gives bitwise the same values); consolidated weights equal
`engine.module_state_dict()`; the consolidated file loads into the plain model.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.engine_helpers import assert_close_relative, base_config, global_batch, train_reference
from tests.harness import run_distributed
from zerodist.models import make_mlp

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH, SAVE_AT, TOTAL = 12, 3, 6  # 12 rows divide among 1, 2, 3 and 4 ranks
KINDS = ("param", "optimizer.exp_avg", "optimizer.exp_avg_sq")


def _engine(stage: int, precision: str = "fp32", seed: int = 0):
    config = base_config(stage, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=None,
                         zero_optimization={"reduce_bucket_size": 700, "allgather_bucket_size": 700})
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = zerodist.initialize(model=make_mlp(seed=seed), config=config)
    return engine


def _train(engine, stop: int) -> None:
    rank, micro = comm.get_rank(), engine.batch.micro_batch_size
    for step in range(engine.global_steps, stop):
        x, y = global_batch(step, GLOBAL_BATCH)
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()


def save_body(save_dir: str, stage: int, precision: str) -> dict[str, torch.Tensor]:
    engine = _engine(stage, precision)
    _train(engine, SAVE_AT)
    engine.save_checkpoint(save_dir)
    return engine.module_state_dict()


def load_body(save_dir: str, stage: int, precision: str, again_dir: str) -> dict[str, torch.Tensor]:
    engine = _engine(stage, precision, seed=7)  # other weights: the checkpoint must replace them
    engine.load_checkpoint(save_dir)
    engine.save_checkpoint(again_dir)  # the state as this layout holds it, for the exactness check
    _train(engine, TOTAL)
    return engine.module_state_dict()


def _consolidated(path) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: ckpt.consolidate_checkpoint(path, kind=kind) for kind in KINDS}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Checkpoints saved at step 3, by (world size, stage, precision), built on first use."""
    made = {}

    def get(world: int, stage: int, precision: str = "fp32"):
        key = (world, stage, precision)
        if key not in made:
            path = tmp_path_factory.mktemp(f"w{world}s{stage}{precision}")
            state = run_distributed(save_body, world, str(path), stage, precision)[0]
            made[key] = (path, state)
        return made[key]
    return get


RESHARDS = [
    ((2, 2), (1, 0)), ((2, 2), (1, 1)), ((2, 2), (4, 1)), ((2, 2), (3, 2)), ((4, 1), (2, 2)), ((1, 0), (2, 2)),
    ((1, 0), (3, 1)), ((3, 2), (4, 0)),
    ((2, 2), (1, 3)), ((2, 2), (4, 3)),
    ((2, 3), (1, 0)), ((2, 3), (4, 1)),
    ((4, 3), (3, 3)), ((1, 3), (2, 2)),
]


@pytest.mark.parametrize("source,target", RESHARDS, ids=lambda wt: f"w{wt[0]}s{wt[1]}")
def test_load_at_another_world_size_and_stage(sources, tmp_path, source, target):
    path, saved = sources(*source, "fp32")
    consolidated = ckpt.consolidate_checkpoint(path)
    for key in saved:  # the consolidated weights are the engine's own, bit for bit
        assert torch.equal(consolidated[key], saved[key]), key
    again = tmp_path / "again"
    final = run_distributed(load_body, target[0], str(path), target[1], "fp32", str(again))[0]
    before, after = _consolidated(path), _consolidated(again)
    for kind in KINDS:
        for key in before[kind]:
            assert torch.equal(after[kind][key], before[kind][key]), f"{kind} of {key} changed in the reshard"
    reference, _ = train_reference(TOTAL, rows=GLOBAL_BATCH)
    assert_close_relative(final, reference, 1e-6)


def test_mixed_precision_reshard_keeps_fp32_master_weights(sources, tmp_path):
    path, saved = sources(2, 2, "bf16")
    consolidated = ckpt.consolidate_checkpoint(path)
    assert all(v.dtype == torch.float32 for v in consolidated.values())
    for key in saved:  # bf16 parameters are the fp32 master weights rounded
        assert torch.equal(consolidated[key].to(torch.bfloat16), saved[key]), key
    final = run_distributed(load_body, 4, str(path), 1, "bf16", str(tmp_path / "again"))[0]
    before, after = _consolidated(path), _consolidated(tmp_path / "again")
    for kind in KINDS:
        for key in before[kind]:
            assert torch.equal(after[kind][key], before[kind][key]), f"{kind} of {key}"
    reference, _ = train_reference(TOTAL, rows=GLOBAL_BATCH)
    assert_close_relative({k: v.float() for k, v in final.items()}, reference, 3e-2)


@pytest.mark.slow
def test_consolidated_file_loads_into_the_plain_model_without_zerodist(sources, tmp_path):
    path, saved = sources(2, 2, "fp32")
    script = ("import sys, torch, safetensors.torch as st; sys.modules['zerodist'] = None\n"
              "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 35), "
              "torch.nn.ReLU(), torch.nn.Linear(35, 8))\n"
              "for name in sys.argv[1:]:\n"
              "    state = st.load_file(name) if name.endswith('.safetensors') else torch.load(name, weights_only=True)\n"
              "    print(model.load_state_dict(state))\n")
    outputs = []
    for name in ("model.safetensors", "model.pt"):
        done = subprocess.run([sys.executable, "-m", "zerodist", "checkpoint", "consolidate", str(path),
                               str(tmp_path / name)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"wrote {tmp_path / name}: 6 tensors, 1,987 values" in done.stdout
        outputs.append(tmp_path / name)
    done = subprocess.run([sys.executable, "-c", script, *map(str, outputs)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.stdout.count("<All keys matched successfully>") == 2, done.stdout + done.stderr
    import safetensors.torch

    for key, value in safetensors.torch.load_file(outputs[0]).items():
        assert torch.equal(value, saved[key])


class WithBuffers(torch.nn.Module):
    """Trained layers, a frozen one, a BatchNorm (float and int64 buffers) and tied weights."""

    def __init__(self, seed: int):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = torch.nn.Linear(16, 32, bias=False)
            self.frozen = torch.nn.Linear(32, 32)
            self.norm = torch.nn.BatchNorm1d(32)
            self.out = torch.nn.Linear(32, 16, bias=False)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(16, 8)
        self.tied = self.head  # the same module under two names: tied weights in state_dict()

    def forward(self, x):
        return self.head(self.out(self.norm(self.frozen(self.embed(x)))))


def buffers_body(save_dir: str, stage: int, save: bool) -> dict[str, torch.Tensor]:
    config = base_config(stage, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=None)
    engine, *_ = zerodist.initialize(model=WithBuffers(seed=0 if save else 5), config=config)
    if save:
        _train(engine, SAVE_AT)
        engine.save_checkpoint(save_dir)
    else:
        engine.load_checkpoint(save_dir)
    return engine.module_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_buffers_frozen_and_tied_weights_round_trip(tmp_path, stage):
    saved = run_distributed(buffers_body, 2, str(tmp_path), 2, True)[0]
    assert saved["norm.num_batches_tracked"] == SAVE_AT and saved["tied.weight"] is not None
    consolidated = ckpt.consolidate_checkpoint(tmp_path)
    assert list(consolidated) == list(saved)
    for key in saved:
        assert torch.equal(consolidated[key], saved[key]), key
    assert consolidated["tied.weight"] is consolidated["head.weight"]
    plain = WithBuffers(seed=9)
    plain.load_state_dict(consolidated)
    loaded = run_distributed(buffers_body, 1, str(tmp_path), stage, False)[0]
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key
