"""One rank of a run whose ranks disagree: `python hang_script.py CASE CHECKPOINT_DIR`.

extra-step-barrier / extra-step-save: rank 1 trains one step more; rank 0 then calls
`comm.barrier()` / `save_checkpoint()`. frozen: rank 1 stops itself (SIGSTOP) before an all-reduce.
A barrier case may add what a loaded machine does to the timing:
  -rank0-late: rank 0 reaches its barrier LATE_S after rank 1 is seen blocked, so rank 1 times out
    first and rank 0 finds the connection closed before its own timeout;
  -rank1-late-slow: rank 1 blocks LATE_S after rank 0 is seen blocked, so rank 0 times out first and
    exits, and rank 1 takes 3 s more to say why it failed (as a starved process would), by which
    time rank 0 (which hosts the store) would long have exited.
The late rank waits for its peer's block as the peer's watchdog publishes it (1-2 s into the block),
not for a fixed time from the end of step 2: under load the peer's extra step could outlast a fixed
4 s sleep, and then the "late" rank blocked first, timed out first, and the case tested the other
order (the likely cause of rank0-late's one failure in a loaded suite run: with rank 1's extra step
delayed 6 s the old script failed that case 4 times in 5, this one in none of 4). Each order's margins are then a few
seconds of an idle process's wake-ups, not a loaded machine's compute: the late rank blocks 3-4 s
after its peer, has published where it is 4-6 s after, and the first timeout comes at 12 s.
"""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.models import make_mlp


LATE_S = 2.0


def forward(engine, step):
    g = torch.Generator().manual_seed(step)
    return F.mse_loss(engine(torch.randn(4, 16, generator=g)), torch.randn(4, 8, generator=g))


def train(engine, steps):
    for step in range(steps):
        engine.backward(forward(engine, step))
        engine.step()


def wait_until_blocked(peer: int, op: str) -> None:
    """Until `peer`'s watchdog has published that it is blocked in `op` (a named error after a minute)."""
    from zerodist.comm.watchdog import watchdog

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        position = watchdog.position_of(peer)
        if position is not None and position.get("state") == "blocked" and position.get("op") == op:
            return
        time.sleep(0.1)
    raise RuntimeError(f"rank {peer} was not seen blocked in {op} within 60 s")


def slow_down_failures() -> None:
    from zerodist.comm.watchdog import Watchdog

    failure = Watchdog._failure

    def slow_failure(self, block, error):
        time.sleep(3)
        return failure(self, block, error)

    Watchdog._failure = slow_failure


def main(case: str, directory: str) -> None:
    rank = comm.get_rank()
    if case == "frozen":
        for step in range(3):
            if rank == 1 and step == 2:
                print(f"rank 1 stops itself at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            comm.all_reduce(torch.ones(8))
        return
    engine, *_ = zerodist.initialize(model=make_mlp(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    train(engine, 2)
    if case.endswith("-rank0-late") and rank == 0:
        wait_until_blocked(1, "reduce_scatter")
        time.sleep(LATE_S)
    if case.endswith("-rank1-late-slow") and rank == 1:
        loss = forward(engine, 2)  # computed before the wait: only the backward lies between it and the block
        wait_until_blocked(0, "barrier")
        time.sleep(LATE_S)
        slow_down_failures()
        engine.backward(loss)
        engine.step()
    else:
        train(engine, rank)
    print(f"rank {rank} blocks at {time.time():.3f}", flush=True)
    if case.startswith("extra-step-barrier"):
        comm.barrier()
    else:
        engine.save_checkpoint(directory)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
