"""The hang watchdog: ranks that disagree, or a frozen rank, give a line naming who waits for
whom within the warning threshold, then a named error on every rank at the collective timeout."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "comm", "hang_script.py")
WARNING_S, TIMEOUT_S = 2, 12
# The no-hang guard, from the start of the ranks (their start-up on a loaded machine included): far
# above the 12 s timeout plus start-up at a load of 77 on 2 cores, far below the 600 s a timeout
# setting that did not apply would wait. Nothing here asserts on wall time within it: how soon a
# rank fails after its block was a margin of 30 s that start-up and scheduling noise could eat.
DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(case: str, tmp_path) -> list[subprocess.Popen]:
    port = _free_port()
    ranks = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "ZERODIST_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ZERODIST_TIMEOUT=str(TIMEOUT_S), ZERODIST_HANG_WARNING=str(WARNING_S),
                   PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        ranks.append(subprocess.Popen([sys.executable, SCRIPT, case, str(tmp_path / "ckpt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return ranks


def _finish(process: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        raise AssertionError(f"a rank hung past the test's deadline and was killed:\n{out[-4000:]}") from None
    return out


# case -> rank 0's error and where rank 0 waits. The "-late" cases are the orders a loaded machine
# makes (hang_script.py says how, anchored on the peer's published block, so that load cannot swap
# them): whichever rank leaves first, the other fails by name too.
CASES = {
    "extra-step-barrier": ("CollectiveTimeoutError", r"barrier #\d+ on group 'world'"),
    "extra-step-save": ("CheckpointAgreementError", r"exchange 'checkpoint-save' #0"),
    "extra-step-barrier-rank0-late": ("CollectiveTimeoutError", r"barrier #\d+ on group 'world'"),
    "extra-step-barrier-rank1-late-slow": ("CollectiveTimeoutError", r"barrier #\d+ on group 'world'"),
}


@pytest.fixture(scope="module")
def disagreeing_runs(tmp_path_factory) -> dict[str, tuple[list[subprocess.Popen], list[str]]]:
    """Every case's two ranks, and the frozen case's, run at once: each waits out the same collective
    timeout, idle, so together they take the time of one."""
    started = {case: _start(case, tmp_path_factory.mktemp(case)) for case in [*CASES, "frozen"]}
    deadline = time.monotonic() + DEADLINE_S
    runs = {"frozen": _finish_frozen(*started.pop("frozen"), deadline)}
    for case, ranks in started.items():
        outs = [_finish(p, deadline) for p in ranks]
        runs[case] = (ranks, outs)
    return runs


def _finish_frozen(rank0: subprocess.Popen, rank1: subprocess.Popen, deadline: float):
    """Rank 0 fails while rank 1 is stopped; rank 1 is continued after that."""
    out0 = _finish(rank0, deadline)
    stopped = rank1.stdout.readline()
    assert "rank 1 stops itself" in stopped, stopped
    os.kill(rank1.pid, signal.SIGCONT)
    out1 = _finish(rank1, deadline)
    return (rank0, rank1), (out0, stopped + out1)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_name_each_other_then_fail_by_name(case, disagreeing_runs):
    rank0_error, rank0_at = CASES[case]
    ranks, outs = disagreeing_runs[case]
    for rank, (process, out) in enumerate(zip(ranks, outs)):
        assert process.returncode != 0, f"rank {rank} exited 0:\n{out[-3000:]}"
    rank0, rank1 = outs
    # rank 0 names rank 1 and where it is: inside its extra step's gradient reduction
    assert re.search(rf"rank 0: waiting \d+ s for rank\(s\) \[1\] at {rank0_at}", rank0), rank0[-3000:]
    assert re.search(r"rank 1 is at reduce_scatter #\d+ on group .* (step|start_grad_sync|finish)", rank0), rank0[-3000:]
    assert re.search(r"rank 1: waiting \d+ s for rank\(s\) \[0\] at reduce_scatter #\d+", rank1), rank1[-3000:]
    # (rank 0 reaches its barrier only after rank 1's warning in the rank0-late case)
    assert re.search(r"rank 0 (is at|failed \d+ s ago in) (barrier|exchange)", rank1), rank1[-3000:]
    # a timeout by name on rank 0 even where it found rank 1's connection closed first (rank 1 had
    # timed out and left: [Note: a lost connection after a peer's timeout] in watchdog.py)
    assert re.search(rf"{rank0_error}: .*rank", rank0), rank0[-3000:]
    # rank 1 times out too, or finds rank 0's connection closed once rank 0 has failed: named either
    # way, and saying whom it waited for even when it reads the store late ([Note: the failed rank lingers])
    assert re.search(r"zerodist.comm.watchdog.Collective(Timeout)?Error: rank 1: waiting", rank1), rank1[-3000:]
    # the rank that left first is reported as having timed out, not as a program that ended early
    if case.endswith("-rank0-late"):
        assert re.search(r"rank 1 failed \d+ s ago in reduce_scatter .*: timed out", rank0), rank0[-3000:]
    if case.endswith("-rank1-late-slow"):
        assert re.search(r"rank 0 failed \d+ s ago in barrier .*: timed out \(it has exited since\)", rank1), rank1[-3000:]


def test_a_frozen_rank_is_named_and_every_rank_fails_by_name(disagreeing_runs):
    (rank0, rank1), (out0, out1) = disagreeing_runs["frozen"]
    assert rank0.returncode != 0 and rank1.returncode != 0
    assert re.search(r"rank 0: waiting \d+ s for rank\(s\) \[1\] at all_reduce #2 on group 'world'", out0), out0
    assert "rank 1 has not been blocked in a collective for long" in out0
    assert re.search(r"CollectiveTimeoutError: rank 0: waiting \d+ s for rank\(s\) \[1\] at all_reduce #2", out0), out0
    # continued after rank 0 left, rank 1 finds its peer gone and says so by name too
    assert re.search(r"CollectiveError: rank 1: .* in all_reduce #2 on group 'world' .* main;", out1), out1
    # ... never as waiting for rank 0, which waited for it (test_the_late_rank_..., below, with the store up)
    assert not re.search(r"rank 1: waiting \d+ s for rank", out1), out1
    # and its reads of the store, whose host (rank 0) has left, add no C++ TCPStore backtraces ([Note: store dumps])
    assert "TCPStore.cpp" not in out1 and "frame #" not in out1, out1
    assert re.search(r"all_reduce #2 on group 'world' \(ranks 0-1\) failed after \d+ s: .*Connection closed by peer",
                     out1), out1


@pytest.mark.unit
def test_the_call_site_is_the_users_line_past_torchs_frames_between_zerodists():
    """A collective issued from a hook inside Module.__call__ inside the engine: the user's line, not
    torch's module.py, is shown after zerodist's frame."""
    from types import SimpleNamespace

    import torch

    from zerodist.comm import watchdog

    package = os.path.dirname(os.path.dirname(os.path.abspath(watchdog.__file__)))
    module_py = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "nn", "modules", "module.py")
    chain = [("/home/user/train.py", 40, "main"), (module_py, 1775, "_call_impl"),
             (os.path.join(package, "engine", "engine.py"), 120, "forward"), (module_py, 1786, "_call_impl"),
             (os.path.join(package, "zero", "hooks.py"), 88, "pre_forward"),
             (os.path.join(package, "comm", "collectives.py"), 300, "all_gather")]
    frame = None
    for path, line, name in chain:
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=path, co_name=name), f_lineno=line, f_back=frame)
    site = watchdog.call_site(frame)
    assert site.endswith("<- /home/user/train.py:40 main") and "hooks.py:88 pre_forward" in site, site


@pytest.mark.unit
def test_the_late_rank_says_its_peer_waited_for_it_not_that_it_waits_for_the_peer(monkeypatch):
    """A rank continued after SIGSTOP reaches the collective its peer timed out in: it was the missing
    one. It said "rank 1: waiting 0 s for rank(s) [0]", blaming the healthy rank."""
    from zerodist.comm import watchdog

    monkeypatch.setattr(watchdog.dist, "get_rank", lambda group=None: 1)
    ticket = watchdog.Ticket("all_reduce", "world", (0, 1), 2)
    block = watchdog._Block(ticket, time.monotonic(), -1)
    timed_out = {"state": "failed", "at": "all_reduce #2 on group 'world' (ranks 0-1) at train.py:9 main",
                 "error": "timed out", "op": "all_reduce", "group": "world", "seq": 2, "time": time.time() - 30}
    text = watchdog.Watchdog().explain(block, 0.0, {0: timed_out})
    assert text.startswith("rank 1: late in all_reduce #2 on group 'world' (ranks 0-1)"), text
    assert "rank(s) [0] reached it first, waited for this rank until the collective timeout and left" in text
    assert "rank 0 failed 30 s ago in all_reduce #2" in text
    elsewhere = {**timed_out, "seq": 1}  # a peer that timed out in another collective: this rank waits for it
    assert watchdog.Watchdog().explain(block, 0.0, {0: elsewhere}).startswith("rank 1: waiting 0 s for rank(s) [0]")


@pytest.mark.unit
def test_store_dumps_are_stripped_and_nothing_else():
    from zerodist.comm.watchdog import strip_store_dumps

    text = ("before\n[rank1]:[W1127 10:40:50.330108343 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=9): "
            "Broken pipe\nException raised from sendBytes at Utils.hpp:758 (most recent call first):\nframe #0: "
            "c10::Error::Error() + 0x9d\n<omitting python frames>\nframe #21: _start + 0x21\n\nafter\n")
    assert strip_store_dumps(text) == "before\nafter\n"
