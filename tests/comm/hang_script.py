"""One rank of a run whose ranks disagree: `python hang_script.py CASE CHECKPOINT_DIR`.

extra-step-barrier / extra-step-save: rank 1 trains one step more; rank 0 then calls
`comm.barrier()` / `save_checkpoint()`. frozen: rank 1 stops itself (SIGSTOP) before an all-reduce.
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
    train(engine, 2 + rank)
    print(f"rank {rank} blocks at {time.time():.3f}", flush=True)
    if case == "extra-step-barrier":
        comm.barrier()
    else:
        engine.save_checkpoint(directory)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
