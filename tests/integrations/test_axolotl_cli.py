"""axolotl's CLI through `zerodist run --as-deepspeed`, with axolotl's `zero2.json` and `zero3.json`, logs the
same losses as the same CLI under DDP (within 1e-5, fp32, 2 ranks), and rank 0 says zerodist trains.
Runs tests/integrations/axolotl_cli_script.py; skipped where axolotl is not installed (it is no
dependency of zerodist: docs/integrations.md, "axolotl", says how it installs on a CPU-only machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.processes import run_group

SCRIPT = Path(__file__).resolve().parent / "axolotl_cli_script.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(3000)]


def test_axolotl_train_through_the_switch_gives_ddps_losses(tmp_path):
    pytest.importorskip("axolotl.cli.main")
    result = run_group([sys.executable, str(SCRIPT), str(tmp_path)], timeout=3000)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("z2 vs ddp") for line in lines) and any(line.startswith("z3 vs ddp") for line in lines)
