"""The layout-invariant mode's sampler: micro-batch k of every global batch holds the same samples
in every layout (docs/determinism.md).

Each epoch is one permutation of the dataset (torch.randperm seeded with seed + epoch, as
DistributedSampler draws it, but never dealt round-robin), cut into global batches of
K * micro samples (the last partial one dropped); global batch s is cut into micro-batches
0..K-1 in order. Data rank r yields, for each global batch, the micro-batches
`micro_batch_index(r, j, ...)` for its accumulation steps j = 0..A-1 (zerodist/zero/canonical.py:
contiguous r*A + j at ZeRO 0/1, interleaved j*D + r at ZeRO 2/3).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from zerodist.zero.canonical import micro_batch_index


class LayoutInvariantSampler(Sampler[int]):
    """One data rank's sample indices, micro-batch after micro-batch, in its accumulation order."""

    def __init__(self, dataset_size: int, *, micro_batch_size: int, accumulation: int, num_replicas: int, rank: int,
                 shard_gradients: bool, shuffle: bool = True, seed: int = 0):
        self.dataset_size, self.micro, self.accumulation = dataset_size, micro_batch_size, accumulation
        self.num_replicas, self.rank, self.shard_gradients = num_replicas, rank, shard_gradients
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.global_batch = micro_batch_size * accumulation * num_replicas
        self.steps = dataset_size // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        for step in range(self.steps):
            start = step * self.global_batch
            for j in range(self.accumulation):
                k = micro_batch_index(self.rank, j, self.num_replicas, self.accumulation, self.shard_gradients)
                yield from order[start + k * self.micro: start + (k + 1) * self.micro]

    def __len__(self) -> int:
        return self.steps * self.accumulation * self.micro
