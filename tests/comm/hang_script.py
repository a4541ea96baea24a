"""One rank of a run whose ranks disagree: `python hang_script.py CASE CHECKPOINT_DIR`.

extra-step-barrier / extra-step-save: rank 1 trains one step more; rank 0 then calls
`comm.barrier()` / `save_checkpoint()`. frozen: rank 1 stops itself (SIGSTOP) before an all-reduce.
A barrier case may add what a loaded machine does to the timing:
  -rank0-late: rank 0 reaches its barrier 4 s after rank 1 blocks, so rank 1 times out first and
    rank 0 finds the connection closed before its own timeout;
  -rank1-late-slow: rank 1 blocks 4 s after rank 0, so rank 0 times out first and exits, and rank 1
    takes 3 s more to say why it failed (as a starved process would), by which time rank 0 (which
    hosts the store) would long have exited.
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


def train(engine, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        loss = F.mse_loss(engine(torch.randn(4, 16, generator=g)), torch.randn(4, 8, generator=g))
        engine.backward(loss)
        engine.step()


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
    if case.endswith(f"-rank{rank}-late") or case.endswith(f"-rank{rank}-late-slow"):
        time.sleep(4)
    if case.endswith(f"-rank{rank}-late-slow"):
        slow_down_failures()
    train(engine, rank)
    print(f"rank {rank} blocks at {time.time():.3f}", flush=True)
    if case.startswith("extra-step-barrier"):
        comm.barrier()
    else:
        engine.save_checkpoint(directory)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
