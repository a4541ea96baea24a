"""TRL's SFT with a PEFT LoRA adapter, unmodified, trains on zerodist at ZeRO-2 and ZeRO-3 with DDP's
losses, and at ZeRO-3 each rank holds half of the frozen base model ([Note: frozen parameters at stage 3]
in zerodist/zero/apply.py), as DeepSpeed partitions it. Needs TRL and PEFT (skipped without them; not in
the test extras)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integrations" / "trl_sft_lora_script.py"


def _launch(out: Path, stage: int | None) -> dict:
    args = [sys.executable, "-m", "zerodist", "run", *(["--as-deepspeed"] if stage is not None else []),
            "--nproc", "2", str(SCRIPT), "--out", str(out), *(["--stage", str(stage)] if stage is not None else [])]
    result = run_group(args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_trl_sft_with_lora_trains_at_zero_2_and_3_with_ddps_losses_and_the_base_sharded(tmp_path):
    pytest.importorskip("trl", minversion="1.0")
    pytest.importorskip("peft")
    pytest.importorskip("datasets")
    ddp = _launch(tmp_path / "ddp", None)
    assert ddp["model"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert len(ddp["losses"]) == 4
    for stage in (2, 3):
        served = _launch(tmp_path / f"zero{stage}", stage)
        assert served["model"] == "zerodist.engine.engine.Engine"
        assert served["losses"] == pytest.approx(ddp["losses"], abs=1e-5), stage
        if stage == 3:  # the two decoder layers and the root
            assert served["frozen_groups"] == 3
            assert served["frozen_held"] < 0.51 * served["frozen"]
        else:
            assert served["frozen_groups"] == 0
