"""DeepSpeed checkpoints in: `zerodist checkpoint import-deepspeed` and `load_checkpoint` on a
DeepSpeed directory.

Without DeepSpeed: hand-built DeepSpeed-format directories (tests/deepspeed_fixtures.py) at stages
0-3 import exactly, resume with the right optimizer state, and a partial or damaged one fails
naming the file. With DeepSpeed installed: a checkpoint DeepSpeed itself wrote at stages 1, 2 and
3 on 2 ranks resumes in zerodist with the losses of DeepSpeed's own resumed run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests import deepspeed_fixtures as fixtures
from tests import deepspeed_reference as reference
from tests.harness import run_distributed
from tests.processes import run_group
from zerodist.checkpoint import CheckpointCorruptError, CheckpointNotFoundError, consolidate_checkpoint
from zerodist.checkpoint.deepspeed_import import DeepSpeedImportError, import_deepspeed

ROOT = Path(__file__).resolve().parents[2]
LOSS_TOLERANCE = 1e-6


# ---------------------------------------------------------------- against DeepSpeed itself

@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """DeepSpeed writes checkpoints at stages 0-3 and resumes each (one 2-rank job, all stages)."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_group([sys.executable, "-m", "tests.deepspeed_reference", str(out), "0", "1", "2", "3"], timeout=500,
                       env=env, cwd=ROOT)
    assert result.returncode == 0, f"DeepSpeed reference run failed:\n{result.stderr[-4000:]}"
    return out, json.loads((out / "losses.json").read_text())


def _resume_in_zerodist(checkpoint_dir: str, stage: int, load_optimizer_states: bool = True) -> tuple[Any, list[float]]:
    model = reference.make_model()
    config = reference.config(stage)
    # The same global batch at any world size: micro-steps x ranks x rows.
    config["train_micro_batch_size_per_gpu"] = reference.MICRO_BATCH * reference.WORLD_SIZE // comm.get_world_size()
    engine, *_ = zerodist.initialize(model=model, model_parameters=reference.param_groups(model), config=config)
    _, client_state = engine.load_checkpoint(checkpoint_dir, load_optimizer_states=load_optimizer_states)
    assert engine.global_steps == reference.STEPS_BEFORE
    losses = reference.train_steps(engine, reference.STEPS_BEFORE, reference.STEPS_AFTER, comm.get_rank(),
                                   comm.get_world_size())
    return client_state, losses


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_deepspeed_checkpoint_resumes_in_zerodist_with_deepspeeds_losses(deepspeed_run: Any, stage: int) -> None:
    out, deepspeed_losses = deepspeed_run
    results = run_distributed(_resume_in_zerodist, reference.WORLD_SIZE, str(out / f"stage{stage}"), stage,
                              timeout=120)
    worst = 0.0
    for rank, (client_state, losses) in enumerate(results):
        assert client_state == reference.CLIENT_STATE
        expected = deepspeed_losses[str(stage)][rank]
        assert len(losses) == len(expected)
        worst = max([worst] + [abs(a - b) for a, b in zip(losses, expected)])
    print(f"stage {stage}: largest loss difference from DeepSpeed's resumed run {worst:.3g}")
    assert worst <= LOSS_TOLERANCE, f"stage {stage}: losses differ from DeepSpeed's resumed run by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_comparison_notices_a_lost_optimizer_state(deepspeed_run: Any) -> None:
    """The tolerance is meaningful: resuming without Adam's moments moves the losses far beyond it."""
    out, deepspeed_losses = deepspeed_run
    results = run_distributed(_resume_in_zerodist, reference.WORLD_SIZE, str(out / "stage2"), 2, False, timeout=120)
    worst = max(abs(a - b) for (_, losses), expected in zip(results, deepspeed_losses["2"])
                for a, b in zip(losses, expected))
    assert worst > 1000 * LOSS_TOLERANCE


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_deepspeed_stage_3_checkpoint_resumes_on_one_rank_at_stage_1(deepspeed_run: Any) -> None:
    """Another world size and stage: each micro-step's loss is the mean of DeepSpeed's two ranks'."""
    out, deepspeed_losses = deepspeed_run
    (client_state, losses), = run_distributed(_resume_in_zerodist, 1, str(out / "stage3"), 1, timeout=120)
    expected = [sum(pair) / 2 for pair in zip(*deepspeed_losses["3"])]
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"stage 3 on 2 ranks -> stage 1 on 1 rank: largest loss difference {worst:.3g}")
    # One rank sums the batch in another order than two: a float32 loss near 4.2 has an ulp of
    # 4.8e-7, and the mean of two rank losses adds one more rounding.
    assert worst <= 4 * LOSS_TOLERANCE


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_hand_built_fixtures_have_deepspeeds_layout(deepspeed_run: Any, tmp_path: Path, stage: int) -> None:
    """The files tests/deepspeed_fixtures.py writes (for the tests without DeepSpeed) have the
    names and keys of the ones DeepSpeed wrote."""
    out, _ = deepspeed_run
    real = out / f"stage{stage}" / "global_step3"
    made = fixtures.write_deepspeed_checkpoint(tmp_path, stage, reference.WORLD_SIZE).tag_dir
    assert sorted(p.name for p in made.iterdir()) == sorted(p.name for p in real.iterdir())
    for path in real.iterdir():
        theirs = torch.load(path, weights_only=False)
        ours = torch.load(made / path.name, weights_only=False)
        assert set(ours) <= set(theirs) | set(fixtures.CLIENT_STATE)
        if "optimizer_state_dict" in theirs:
            assert set(ours["optimizer_state_dict"]) == set(theirs["optimizer_state_dict"])


# ---------------------------------------------------------------- without DeepSpeed

def _truth_and_import(tmp_path: Path, stage: int, world_size: int) -> tuple[fixtures.Truth, Path]:
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "deepspeed", stage, world_size)
    tag_dir, _ = import_deepspeed(tmp_path / "deepspeed", tmp_path / "zerodist")
    return truth, tag_dir


@pytest.mark.unit
@pytest.mark.parametrize("stage,world_size", [(0, 2), (1, 3), (2, 3), (3, 3), (3, 2)])
def test_import_gives_back_exactly_what_the_deepspeed_files_hold(tmp_path: Path, stage: int, world_size: int) -> None:
    truth, tag_dir = _truth_and_import(tmp_path, stage, world_size)
    assert tag_dir == tmp_path / "zerodist" / "global_step5"
    weights = consolidate_checkpoint(tmp_path / "zerodist")
    assert list(weights) == list(truth.module)  # the plain model's keys, in order, tied weight included
    for name, value in truth.params.items():
        assert torch.equal(weights[name], value), name
    assert torch.equal(weights["head.weight"], truth.params["emb.weight"])
    model = fixtures.FixtureModel(frozen=True)
    for key in ("gain", "frozen.weight", "frozen.bias"):
        assert torch.equal(weights[key], model.state_dict()[key]), key
    for kind, expected in (("exp_avg", truth.exp_avg), ("exp_avg_sq", truth.exp_avg_sq)):
        saved = consolidate_checkpoint(tmp_path / "zerodist", kind=f"optimizer.{kind}")
        assert all(torch.equal(saved[n], expected[n]) for n in expected), kind


def _resume_fixture(path: str, stage: int) -> tuple[Any, int, dict[str, torch.Tensor]]:
    model = fixtures.FixtureModel(frozen=True)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1.0}}, "steps_per_print": 10**9}
    engine, *_ = zerodist.initialize(model=model, model_parameters=fixtures.param_groups(model), config=config)
    _, client_state = engine.load_checkpoint(path)
    rows = slice(comm.get_rank() * 4, (comm.get_rank() + 1) * 4)
    loss = engine(_tokens()[rows]).square().mean()
    engine.backward(loss)
    engine.step()
    return client_state, engine.global_steps, engine.module_state_dict()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(9))


@pytest.mark.multiprocess
def test_an_engine_loads_a_deepspeed_directory_and_steps_with_its_adam_state(tmp_path: Path) -> None:
    """Saved by 3 DeepSpeed ranks at stage 3, loaded into 2 zerodist ranks at stage 2 by
    engine.load_checkpoint(DIR): one more step equals torch's AdamW continuing from the same state."""
    truth = fixtures.write_deepspeed_checkpoint(tmp_path, 3, 3)
    results = run_distributed(_resume_fixture, 2, str(tmp_path), 2, timeout=60)
    model = fixtures.FixtureModel(frozen=True)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in truth.params.items():
            named[name].copy_(value)
    optimizer = torch.optim.AdamW(fixtures.param_groups(model), lr=fixtures.LR)
    for name in truth.params:
        optimizer.state[named[name]] = {"step": torch.tensor(float(fixtures.STEP)), "exp_avg": truth.exp_avg[name].clone(),
                                        "exp_avg_sq": truth.exp_avg_sq[name].clone()}
    model(_tokens()).square().mean().backward()
    optimizer.step()
    for client_state, steps, state in results:
        assert client_state == fixtures.CLIENT_STATE and steps == fixtures.STEP + 1
        for key, value in model.state_dict().items():
            assert torch.allclose(state[key], value, rtol=1e-5, atol=1e-7), key


@pytest.mark.unit
def test_a_partial_deepspeed_checkpoint_names_the_missing_file(tmp_path: Path) -> None:
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "z2", 2, 3)
    (truth.tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DeepSpeedImportError, match="saved by 3 ranks but zero_pp_rank_1_mp_rank_00_optim_states.pt is "
                                                   "missing"):
        import_deepspeed(tmp_path / "z2", tmp_path / "out")
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "z3", 3, 2)
    (truth.tag_dir / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(DeepSpeedImportError, match="zero_pp_rank_1_mp_rank_00_model_states.pt missing"):
        import_deepspeed(tmp_path / "z3", tmp_path / "out")
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "z1", 1, 2)
    (truth.tag_dir / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no mp_rank_00_model_states.pt"):
        import_deepspeed(tmp_path / "z1", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_a_damaged_deepspeed_file_is_named(tmp_path: Path) -> None:
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "ds", 1, 2)
    path = truth.tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt cannot be read"):
        import_deepspeed(tmp_path / "ds", tmp_path / "out")


@pytest.mark.unit
def test_a_class_outside_deepspeeds_checkpoint_vocabulary_is_named(tmp_path: Path) -> None:
    truth = fixtures.write_deepspeed_checkpoint(tmp_path / "ds", 0, 2)
    path = truth.tag_dir / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["custom"] = fixtures.FixtureModel  # a client_state entry of a class the import does not know
    torch.save(states, path)
    with pytest.raises(DeepSpeedImportError, match="holds tests.deepspeed_fixtures.FixtureModel.*--trust-pickle"):
        import_deepspeed(tmp_path / "ds", tmp_path / "out")
    _, state = import_deepspeed(tmp_path / "ds", tmp_path / "out", trust_pickle=True)  # the user trusts the file
    assert state.client_state["custom"] is fixtures.FixtureModel


def _load_partial(path: str) -> str:
    model = fixtures.FixtureModel(frozen=True)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = zerodist.initialize(model=model, model_parameters=fixtures.param_groups(model), config=config)
    with pytest.raises(DeepSpeedImportError) as caught:
        engine.load_checkpoint(path)
    return str(caught.value)


@pytest.mark.multiprocess
def test_loading_a_partial_deepspeed_directory_fails_on_every_rank(tmp_path: Path) -> None:
    truth = fixtures.write_deepspeed_checkpoint(tmp_path, 2, 2)
    (truth.tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    for message in run_distributed(_load_partial, 2, str(tmp_path), timeout=60):
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing" in message


@pytest.mark.unit
def test_cli_import_deepspeed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerodist.cli.main import main

    fixtures.write_deepspeed_checkpoint(tmp_path / "ds", 2, 2)
    assert main(["checkpoint", "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "zd")]) == 0
    out = capsys.readouterr().out
    assert "wrote " + str(tmp_path / "zd" / "global_step5") in out and "5 trained parameters" in out
    assert "AdamW state exp_avg, exp_avg_sq" in out and "from DeepSpeed 0.19.8, ZeRO stage 2, 2 rank(s)" in out
    assert main(["checkpoint", "inspect", str(tmp_path / "zd")]) == 0  # committed, every checksum right
    assert main(["checkpoint", "import-deepspeed", str(tmp_path / "none"), str(tmp_path / "zd2")]) == 1
    assert "not a DeepSpeed checkpoint" in capsys.readouterr().err
