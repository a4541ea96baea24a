"""`zerodist run --as-deepspeed`: transformers' own DeepSpeed path (`TrainingArguments(deepspeed=...)`),
unchanged, trains on zerodist. A plain Trainer script on 2 ranks with LLaMA-Factory's templates logs
the same losses as the same script under DDP, and rank 0 says which engine trains. The serving itself
(module aliases, the `deepspeed` distribution, errors for what zerodist lacks) is checked in a fresh
interpreter, since it changes the import system of the process it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integrations" / "hf_deepspeed_path_script.py"
TEMPLATES = REPO / "tests" / "config" / "templates"


def served_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter started as `zerodist run --as-deepspeed` starts each rank."""
    from zerodist.integrations.as_deepspeed import environment

    env = environment({**os.environ, "PYTHONPATH": str(REPO)})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_deepspeed_is_zerodist_with_deepspeeds_distribution_metadata():
    result = served_python("""
        import importlib.metadata, importlib.util
        import zerodist, zerodist.comm, zerodist.zero
        assert importlib.util.find_spec("deepspeed") is not None
        version = importlib.metadata.version("deepspeed")
        assert version == f"0.19.8+zerodist{zerodist.__version__}", version
        import deepspeed
        from deepspeed import comm as dist
        import deepspeed.runtime.lr_schedules as schedules
        from deepspeed.utils import logger, groups
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed.runtime.engine import DeepSpeedEngine
        assert dist is zerodist.comm and deepspeed.zero.GatheredParameters and deepspeed.initialize is zerodist.initialize
        assert zerodist.comm.__spec__.name == "zerodist.comm"   # one module under two names, its own spec kept
        assert DeepSpeedEngine is zerodist.Engine and "WarmupLR" in schedules.VALID_LR_SCHEDULES
        assert deepspeed.runtime.lr_schedules is schedules
        from transformers.integrations.deepspeed import is_deepspeed_available
        from transformers.utils.versions import require_version
        assert is_deepspeed_available()
        require_version("deepspeed>=0.9.3")             # transformers' gate
        for missing in ("deepspeed.ops.transformer", "deepspeed.module_inject.auto_tp"):
            try:
                __import__(missing)
            except ModuleNotFoundError as error:
                assert "served by zerodist" in str(error) and missing.startswith(error.name), error
            else:
                raise AssertionError(missing)
        try:
            deepspeed.init_inference
        except AttributeError as error:
            assert "served by zerodist" in str(error)
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
    # Rank 0 (a one-process run) says once which engine serves `import deepspeed`.
    assert result.stderr.count("zerodist trains: `import deepspeed` is served by zerodist") == 1


def test_a_deepspeed_imported_before_the_switch_is_refused_not_used(tmp_path):
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    result = subprocess.run([sys.executable, "-c", "import deepspeed\nfrom zerodist.integrations import as_deepspeed\n"
                             "as_deepspeed.install()"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert result.returncode != 0
    assert "was imported before zerodist could serve `import deepspeed`" in result.stderr
    assert "zerodist run --as-deepspeed" in result.stderr


def launch(out: Path, template: str | None, as_deepspeed: bool) -> tuple[dict, str]:
    args = [sys.executable, "-m", "zerodist", "run", *(["--as-deepspeed"] if as_deepspeed else []), "--nproc", "2",
            str(SCRIPT), "--out", str(out)]
    if template is not None:
        args += ["--deepspeed", str(TEMPLATES / template)]
    result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), result.stderr


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[dict, Path]:
    """The same script under DDP: one reference for every stage (it reads no template)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("ddp")
    return launch(out, None, as_deepspeed=False)[0], out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_deepspeed_argument_trains_on_zerodist_with_ddps_losses(tmp_path, stage, ddp_run):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    served, log = launch(tmp_path / "zerodist", f"llamafactory_ds_z{stage}_config.json", as_deepspeed=True)
    ddp, ddp_out = ddp_run
    assert served["engine"] == "zerodist.engine.engine.Engine"
    assert ddp["engine"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert "[zerodist INFO rank 0] zerodist trains: `import deepspeed` is served by zerodist" in log
    assert f"ZeRO stage {stage}" in log and "[zerodist INFO rank 1]" not in log
    assert len(served["losses"]) == 4
    for key in ("losses", "grad_norms", "lrs"):
        assert served[key] == pytest.approx(ddp[key], abs=1e-5), key
    ours = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "zerodist" / "final").state_dict()
    theirs = transformers.LlamaForCausalLM.from_pretrained(ddp_out / "final").state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5
    assert all(torch.isfinite(v).all() for v in ours.values())


@pytest.mark.unit
def test_run_as_deepspeed_runs_a_program_on_path_without_python_and_exec_needs_the_switch(monkeypatch, tmp_path):
    import argparse

    from zerodist.cli import run

    args = argparse.Namespace(nproc=2, nnodes="1", node_rank=None, master_addr=None, master_port=None,
                              rdzv_endpoint=None, rdzv_id="zerodist", max_restarts=0)
    assert "--no-python" in run.torchrun_argv(args, "python3", ["-c", "pass"])  # a program on PATH
    script = tmp_path / "train.py"
    script.write_text("")
    assert "--no-python" not in run.torchrun_argv(args, str(script), [])
    parser = argparse.ArgumentParser()
    run.register(parser.add_subparsers())
    parsed = parser.parse_args(["run", "--exec", "--", "accelerate", "launch", "train.py"])
    with pytest.raises(SystemExit, match="--exec runs a launcher with --as-deepspeed"):
        run.run(parsed)


@pytest.mark.unit
def test_the_switchs_environment_puts_its_directory_first_once():
    from zerodist.integrations.as_deepspeed import alias_directory, environment

    env = environment({"PYTHONPATH": "/a:/b"})
    first = environment(env)
    assert first["PYTHONPATH"] == os.pathsep.join([alias_directory(), "/a", "/b"])
    assert first["ZERODIST_AS_DEEPSPEED"] == "1"
    assert {p.name for p in Path(alias_directory()).iterdir()} >= {"deepspeed", "sitecustomize.py"}
