"""Rank 1 has one batch more than rank 0 (`zerodist run --nproc 2 uneven_script.py`)."""

import torch

import zerodist.comm as comm

for _ in range(3 + comm.get_rank()):
    comm.all_reduce(torch.ones(4))
