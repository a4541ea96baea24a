"""MASTER_PORT held by something else: a listener that is not a store, or another zerodist job's
store. The non-zero ranks fail with a named error within the join timeout instead of hanging."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOIN_TIMEOUT_S = 8
# The no-hang guard, from the rank's start (importing torch on a loaded machine included): far above
# that plus the 8 s join timeout, below the 300 s a join timeout that did not apply would wait. The
# errors below name the 8 s, so nothing asserts on a wall time within it.
DEADLINE_S = 240
JOIN = "import zerodist.comm as c, time; c.init_distributed(); print('JOINED', flush=True); time.sleep(90)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, run_id: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "ZERODIST_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), ZERODIST_TIMEOUT=str(JOIN_TIMEOUT_S), PYTHONPATH=REPO)
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    return subprocess.Popen([sys.executable, "-c", JOIN], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _fails_in_time(process: subprocess.Popen) -> str:
    try:
        out, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the rank hung past the join timeout:\n{process.communicate()[0][-3000:]}") from None
    assert process.returncode != 0 and "JOINED" not in out, out[-3000:]
    return out


def test_a_listener_that_is_not_a_store_fails_within_the_join_timeout():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        out = _fails_in_time(_rank(1, 2, listener.getsockname()[1]))
    assert "DistributedInitError: rank 1 of 2: something listens at" in out
    assert "did not answer as a store within 8 s" in out


def test_a_port_shared_with_a_running_job_is_a_named_error():
    port = _free_port()
    first = [_rank(r, 2, port, run_id="job-a") for r in range(2)]
    try:
        for process in first:
            assert process.stdout.readline().strip() == "JOINED"
        # a job of 3 ranks completes job-a's count of 2: the run ids differ
        out = _fails_in_time(_rank(2, 3, port, run_id="job-b"))
        assert "belongs to another job (run id 'job-a', this rank's is 'job-b')" in out, out[-3000:]
        # without a run id, a job of 2 ranks finds more ranks joined than its WORLD_SIZE
        out = _fails_in_time(_rank(1, 2, port))
        assert "already counts 4 joined ranks, more than WORLD_SIZE 2: it belongs to another job" in out, out[-3000:]
    finally:
        for process in first:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
