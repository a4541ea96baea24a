"""DeepSpeed's `RepeatingLoader`: an iterator over a loader that starts it again when it ends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wraps an iterable (a DataLoader) so that `next()` never raises StopIteration: at the end of
    the data it begins a new pass (a DataLoader with a sampler reshuffles as on any new epoch)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration here, as DeepSpeed's does
