"""Uneven batch counts: the rank left issuing collectives after its peer's program ended gets a
named error that says so (it was gloo's bare "Connection closed by peer ... GLHF")."""

from __future__ import annotations

import os
import sys

from tests.processes import run_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_rank_left_waiting_is_told_its_peer_exited():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    done = run_group([sys.executable, "-m", "zerodist", "run", "--nproc", "2",
                      os.path.join(REPO, "tests", "comm", "uneven_script.py")], cwd=REPO, env=env, timeout=120)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "CollectiveError: rank 1: waiting" in out and "for rank(s) [0] at all_reduce #3" in out, out[-3000:]
    assert "rank 0 exited" in out and "uneven batch counts" in out, out[-3000:]
