"""`zerodist doctor` lists the private torch APIs zerodist uses (zerodist.compat.PRIVATE_APIS)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from tests.processes import run_group
from zerodist import compat
from zerodist.cli import doctor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_report_has_one_line_per_api_and_says_what_happens_without_one(monkeypatch):
    lines = doctor.private_api_report()
    assert len(lines) == 1 + len(compat.PRIVATE_APIS)
    for api, line in zip(compat.PRIVATE_APIS, lines[1:]):
        assert api.name in line and api.used_for in line
    missing = dataclasses.replace(compat.PRIVATE_APIS[0], available=False)
    monkeypatch.setattr(compat, "PRIVATE_APIS", (missing, *compat.PRIVATE_APIS[1:]))
    lines = doctor.private_api_report()
    n = len(compat.PRIVATE_APIS)
    assert lines[0].startswith(f"private torch APIs: {n - 1} of {n} present")
    assert lines[1].startswith("  MISSING ") and f"without it: {missing.without}" in lines[1]


def test_doctor_prints_the_section():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out: subprocess.CompletedProcess = run_group([sys.executable, "-m", "zerodist", "doctor", "--size-mib", "1",
                                                  "--trials", "1"], env=env, capture_output=True, text=True,
                                                 timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "private torch APIs: " in out.stdout
    for api in compat.PRIVATE_APIS:
        assert api.name in out.stdout
