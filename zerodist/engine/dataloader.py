"""The engine's data loader: one rank's slice of the data, a new order every epoch, resumable.

DistributedSampler repeats the same order every epoch unless `set_epoch()` is called, a
classic silent bug. This loader calls it itself at the start of each pass.

It also counts the batches it has handed out in the epoch in progress, so a checkpoint records
the data position and a resumed run continues mid-epoch with the very next batch. The
position is kept in global samples (batches x batch size x ranks), so a run resumed on another
number of ranks with the same global batch continues with the same samples: DistributedSampler
deals the epoch's shuffled indices out round-robin, so global batch k is the same set of
samples for any number of ranks. The DataLoader draws its base seed from its own generator,
reseeded every epoch, so iterating never consumes the global RNG that a checkpoint restores.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class _SkippingSampler(Sampler[int]):
    """The distributed sampler's order for this epoch, from index `skip` on (a resumed epoch)."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class EngineDataLoader:
    """Iterate for one epoch; the next `iter()` starts the next epoch with a fresh order."""

    def __init__(self, dataset: Dataset, *, batch_size: int, num_replicas: int, rank: int, seed: int = 0,
                 collate_fn: Callable[..., Any] | None = None, shuffle: bool = True, sampler: Any = None):
        # `sampler`: one with DistributedSampler's set_epoch and len (the layout-invariant mode's)
        self.sampler: Any = sampler if sampler is not None else DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self._skipping = _SkippingSampler(self.sampler)
        self.generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self._skipping, collate_fn=collate_fn,
                                 drop_last=True, generator=self.generator)
        self.batch_size, self.num_replicas, self.seed = batch_size, num_replicas, seed
        self.epoch = 0  # epochs started
        self.batches_in_epoch = 0  # batches handed out from the epoch in progress
        self._resume_at = 0  # batches to skip at the start of the next epoch (set by load_state_dict)
        self._in_epoch = False  # an epoch was started and not yet exhausted

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.generator.manual_seed(self.seed + self.epoch)
        self._skipping.skip = self._resume_at * self.batch_size
        self.batches_in_epoch, self._resume_at = self._resume_at, 0
        self.epoch += 1
        self._in_epoch = True
        return self._counted(iter(self.loader))

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.batches_in_epoch += 1
            yield batch
        self._in_epoch = False

    def __len__(self) -> int:
        """Batches in a whole epoch."""
        return len(self.sampler) // self.batch_size

    def state_dict(self) -> dict[str, int]:
        """The next batch's place: epoch and global samples already consumed in it."""
        if self._in_epoch and self.batches_in_epoch < len(self):
            return {"epoch": self.epoch - 1, "samples_in_epoch": self.batches_in_epoch * self.batch_size * self.num_replicas}
        return {"epoch": self.epoch, "samples_in_epoch": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self._resume_at = state.get("samples_in_epoch", 0) // (self.batch_size * self.num_replicas)
        self.batches_in_epoch, self._in_epoch = 0, False
