"""DeepSpeed's surface as DeepSpeedExamples' CIFAR script uses it: every subpackage reachable after
`import zerodist as deepspeed` (in a fresh interpreter, nothing imported before), `get_accelerator()`,
and the script itself (tests/integrations/cifar_examples_script.py) on 2 ranks at ZeRO 0-3,
fp32/bf16/fp16, with and without MoE."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from zerodist.accelerator import get_accelerator

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("cifar_examples_script.py")


def test_subpackages_are_attributes_after_a_bare_import():
    code = ("import sys, zerodist as deepspeed\n"
            "assert 'zerodist.moe' not in sys.modules\n"
            "print(deepspeed.moe.layer.MoE.__name__, deepspeed.tensor_parallel.__name__, deepspeed.comm.__name__,\n"
            "      deepspeed.zero.Init.__name__, deepspeed.checkpoint.__name__,\n"
            "      deepspeed.accelerator.get_accelerator().device_name(0),\n"
            "      deepspeed.pipe.PipelineModule.__name__, deepspeed.utils.RepeatingLoader.__name__,\n"
            "      deepspeed.sequence.layer.DistributedAttention.__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["MoE", "zerodist.tensor_parallel", "zerodist.comm", "Init", "zerodist.checkpoint",
                                     "cpu", "PipelineModule", "RepeatingLoader", "DistributedAttention"]


def test_accelerator_on_the_cpu_answers_as_deepspeeds_cpu_accelerator():
    accelerator = get_accelerator()
    assert accelerator is get_accelerator()
    assert (accelerator.device_name(), accelerator.device_name(1), accelerator.current_device_name()) == ("cpu",) * 3
    assert accelerator.device(0) == torch.device("cpu") and accelerator.device_count() == 1
    assert accelerator.is_available() and accelerator.is_bf16_supported() and accelerator.is_fp16_supported()
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert accelerator.on_accelerator(torch.zeros(1))
    accelerator.synchronize()
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()
    assert 0 < accelerator.memory_allocated() <= accelerator.max_memory_allocated()
    assert 0 < accelerator.available_memory() <= accelerator.total_memory()
    accelerator.manual_seed(3)
    first = torch.rand(2)
    accelerator.manual_seed_all(3)
    assert torch.equal(first, torch.rand(2))


def run_script_on_rank(argv: list[str], results: str) -> dict:
    saved = sys.argv
    sys.argv = [str(SCRIPT), *argv, "--results", results]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = saved
    import zerodist.comm as comm

    comm.barrier()
    return json.loads(Path(results).read_text())


MOE = ["--moe", "--num-experts", "2", "--ep-world-size", "2", "--moe-param-group"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cifar_script_losses_are_the_same_at_every_zero_stage(tmp_path, moe):
    # ZeRO stages change where state lives, not the arithmetic: every stage's losses equal stage 0's.
    extra = MOE if moe else []
    losses = {}
    for stage in (0, 1, 2, 3):
        results = str(tmp_path / f"stage{stage}.json")
        report = run_distributed(run_script_on_rank, 2, ["--stage", str(stage), *extra], results, timeout=120)[0]
        assert (report["device"], report["backend"], report["current_device_name"]) == ("cpu", "gloo", "cpu")
        losses[stage] = report["losses"]
    assert len(losses[0]) == 4 and all(torch.isfinite(torch.tensor(losses[0])))
    for stage in (1, 2, 3):
        torch.testing.assert_close(losses[stage], losses[0], atol=1e-6, rtol=0, msg=f"stage {stage}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cifar_script_runs_in_half_precision_with_moe(tmp_path, dtype):
    results = str(tmp_path / "r.json")
    report = run_distributed(run_script_on_rank, 2, ["--stage", "2", "--dtype", dtype, *MOE], results, timeout=120)[0]
    fp32 = run_distributed(run_script_on_rank, 2, ["--stage", "2", *MOE], results, timeout=120)[0]
    # Half precision rounds the weights, so the losses follow fp32's only roughly.
    torch.testing.assert_close(report["losses"], fp32["losses"], atol=5e-2, rtol=0)
