"""Acceptance: DeepSpeed's CIFAR tutorial script (examples/deepspeed_tutorial.py, `import zerodist as
deepspeed`) runs unchanged at ZeRO 0-3 on 2 ranks with the tutorial's config, and its losses equal
a one-process PyTorch run's on the same global batches.

The script runs on the harness's ranks (runpy, with its own command line) for every stage, and
once through `zerodist run` as a user launches it. The reference is plain PyTorch: the same
initial weights, the same global batch per step (DistributedSampler deals one shuffled order out
round-robin, so global batch k is the same samples for any number of ranks), AdamW (DeepSpeed's
"Adam" with weight decay), the WarmupLR formula and clipping at 1.0.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "deepspeed_tutorial.py"
CONFIG = REPO / "examples" / "ds_config.json"
EPOCHS, SAMPLES, GLOBAL_BATCH = 2, 64, 16
LOSS_TOLERANCE = 1e-5


def _config_for_stage(stage: int, directory: Path) -> Path:
    """The tutorial's config at `stage`; at stage 3 every parameter is sharded (the tutorial's net is
    smaller than the default persistence threshold, which would keep it whole)."""
    config = json.loads(CONFIG.read_text())
    config["zero_optimization"]["stage"] = stage
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = directory / f"ds_config_stage{stage}.json"
    path.write_text(json.dumps(config))
    return path


def _script_argv(config: Path, directory: Path) -> list[str]:
    return ["--deepspeed", "--deepspeed_config", str(config), "--epochs", str(EPOCHS), "--samples", str(SAMPLES),
            "--checkpoint_dir", str(directory / "checkpoints"), "--results", str(directory / "results.json")]


def run_script_on_rank(argv: list[str], results: str) -> dict[str, Any] | None:
    """The script as `python deepspeed_tutorial.py ARGV` would run it, on this harness rank."""
    saved = sys.argv
    sys.argv = [str(SCRIPT), *argv]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = saved
    import zerodist.comm as comm

    comm.barrier()  # rank 0 has written the results
    return json.loads(Path(results).read_text()) if comm.get_rank() == 0 else None


def _tutorial_namespace() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT), run_name="tutorial")  # defines Net and cifar_like, runs nothing


def reference_losses(learning: bool = True) -> list[float]:
    """One process, the whole global batch per step; `learning=False` keeps the initial weights
    (to show the comparison can tell training from no training). The last entry is the trained
    model's loss on the script's test images."""
    namespace = _tutorial_namespace()
    torch.manual_seed(0)
    net = namespace["Net"]()
    dataset = namespace["cifar_like"](SAMPLES)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0,
                                                  drop_last=True)
    losses, step = [], 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            images, labels = dataset[order[start:start + GLOBAL_BATCH]]
            loss = F.cross_entropy(net(images), labels)
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            for group in optimizer.param_groups:  # WarmupLR: 0 -> 0.001 over 1000 steps, logarithmic; step n
                # uses iteration n - 1, the first two steps the minimum ([Note: schedule iterations])
                group["lr"] = 0.001 * math.log(max(step, 1)) / math.log(1000) if learning else 0.0
            optimizer.step()
            step += 1
    images, labels = namespace["cifar_like"](SAMPLES // 2, seed=4321).tensors
    with torch.no_grad():
        losses.append(F.cross_entropy(net(images), labels).item())
    return losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses()


def _check_run(results: dict[str, Any], stage: int, reference_and_test: list[float]) -> None:
    *reference, test_loss = reference_and_test
    # The model itself, evaluated after training as the tutorial does, is the reference's model.
    assert abs(results["test_loss"] - test_loss) <= LOSS_TOLERANCE, (results["test_loss"], test_loss)
    losses = results["losses"]
    assert len(losses) == len(reference) == EPOCHS * SAMPLES // GLOBAL_BATCH
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    assert worst <= LOSS_TOLERANCE, f"stage {stage}: losses {losses} differ from the reference {reference} by {worst:.2e}"
    # The checkpoint of epoch 1 came back with its client_state, and the second epoch trained again
    # from it gives the same losses.
    assert results["client_state"]["epoch"] == 0
    assert results["client_state"]["losses"] == losses[:4]
    assert results["load_path"].endswith("global_step4")
    assert results["resumed_losses"] == pytest.approx(losses[4:], abs=1e-6)
    assert results["args_local_rank"] == 0  # initialize() gave args.local_rank the launcher's value
    names = [name for name, _ in _tutorial_namespace()["Net"]().named_parameters()]
    for when, facts in (("before", results["before"]), ("after", results["after"])):
        assert facts["is_module"] and facts["fall_through"], when
        assert facts["named_parameters"] == [f"module.{n}" for n in names]
        assert facts["state_dict_keys"] == [f"module.{n}" for n in names]
        assert facts["parameter_count"] == len(names)
        assert (facts["local_rank"], facts["global_rank"], facts["world_size"], facts["device"]) == (0, 0, 2, "cpu")
        assert (facts["train_batch_size"], facts["train_micro_batch_size_per_gpu"],
                facts["gradient_accumulation_steps"]) == (GLOBAL_BATCH, GLOBAL_BATCH // 2, 1)
        assert (facts["fp16_enabled"], facts["bfloat16_enabled"], facts["zero_optimization_stage"]) == (False, False, stage)
    assert (results["before"]["global_steps"], results["before"]["global_samples"]) == (0, 0)
    assert results["before"]["was_step_applied"] is False
    assert (results["after"]["global_steps"], results["after"]["global_samples"]) == (8, 8 * GLOBAL_BATCH)
    assert results["after"]["was_step_applied"] is True


@pytest.mark.unit
def test_the_reference_tells_training_from_no_training(reference):
    frozen = reference_losses(learning=False)
    assert frozen[0] == pytest.approx(reference[0], abs=1e-7)  # the first step's learning rate is 0
    assert max(abs(a - b) for a, b in zip(frozen, reference)) > 100 * LOSS_TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tutorial_script_matches_one_process_at_every_stage(stage, reference, tmp_path):
    config = _config_for_stage(stage, tmp_path)
    results = run_distributed(run_script_on_rank, 2, _script_argv(config, tmp_path), str(tmp_path / "results.json"),
                              timeout=180)[0]
    _check_run(results, stage, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tutorial_script_launched_by_zerodist_run(reference, tmp_path):
    """As a user runs it: `zerodist run --nproc 2`, its own processes, the tutorial's config file."""
    config = _config_for_stage(2, tmp_path)
    out = run_group([sys.executable, "-m", "zerodist", "run", "--nproc", "2", str(SCRIPT),
                     *_script_argv(config, tmp_path)], timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Finished Training" in out.stdout
    # The tutorial's legacy keys are named once, on rank 0, and nothing else about them is said.
    assert out.stderr.count("ignoring DeepSpeed settings that change nothing in zerodist") == 1
    for key in ("prescale_gradients=false", "fp16.fp16_master_weights_and_grads=false",
                "zero_optimization.allgather_partitions=true", "zero_optimization.cpu_offload=false"):
        assert key in out.stderr
    _check_run(json.loads((tmp_path / "results.json").read_text()), 2, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_tutorial_script_matches_real_deepspeed(tmp_path):
    """Where DeepSpeed is installed: the same script with `import deepspeed` gives the same losses and
    engine facts (state_dict keys, global_samples, ...) as under zerodist, at ZeRO 2.

    One epoch, for the difference docs/deepspeed.md states: DeepSpeed's own loader does not
    reshuffle between epochs (zerodist's does). The WarmupLR schedule runs: its rates are DeepSpeed's,
    step for step."""
    text = SCRIPT.read_text()
    swapped = text.replace("import zerodist as deepspeed  #", "import deepspeed  #").replace(
        "from zerodist import comm as dist", "from deepspeed import comm as dist")
    assert swapped.count("zerodist") == text.count("zerodist") - 2
    script = tmp_path / "tutorial_deepspeed.py"
    script.write_text(swapped)
    config = json.loads(CONFIG.read_text())
    config["zero_optimization"]["stage"] = 2
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    runs = {}
    for name in ("deepspeed", "zerodist"):
        directory = tmp_path / name
        directory.mkdir()
        argv = _script_argv(tmp_path / "ds_config.json", directory) + ["--epochs", "1"]
        if name == "zerodist":
            runs[name] = run_distributed(run_script_on_rank, 2, argv, str(directory / "results.json"), timeout=180)[0]
            continue
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        out = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         str(script), *argv], timeout=400, cwd=directory, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = json.loads((directory / "results.json").read_text())
    deepspeed_run, zerodist_run = runs["deepspeed"], runs["zerodist"]
    assert len(zerodist_run["losses"]) == SAMPLES // GLOBAL_BATCH
    assert zerodist_run["losses"] == pytest.approx(deepspeed_run["losses"], abs=LOSS_TOLERANCE)
    assert zerodist_run["test_loss"] == pytest.approx(deepspeed_run["test_loss"], abs=LOSS_TOLERANCE)
    assert zerodist_run["before"] == deepspeed_run["before"]
    assert zerodist_run["after"] == deepspeed_run["after"]
