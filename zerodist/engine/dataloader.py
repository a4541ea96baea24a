"""The engine's data loader: one rank's slice of the data, a new order every epoch.

DistributedSampler repeats the same order every epoch unless `set_epoch()` is called, a
classic silent bug. This loader calls it itself at the start of each pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class EngineDataLoader:
    """Iterate for one epoch; the next `iter()` starts the next epoch with a fresh order."""

    def __init__(self, dataset: Dataset, *, batch_size: int, num_replicas: int, rank: int, seed: int = 0,
                 collate_fn: Callable[..., Any] | None = None, shuffle: bool = True):
        self.sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=True)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=True)
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
