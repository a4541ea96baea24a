"""Sampler safety: a warning when a new epoch starts with the previous epoch's order.

`DistributedSampler` shuffles with a seed derived from `seed + epoch`, and `epoch` only moves
when someone calls `sampler.set_epoch(epoch)`. Forget it and every epoch replays the first
epoch's order, silently: the loss still goes down, just less well. The engine's own loader
(`initialize(training_data=...)`) calls it itself; for a loader you build, wrap one of them:

    sampler = SamplerWatch(DistributedSampler(dataset))        # pass it as DataLoader(sampler=...)
    loader = DataLoader(dataset, sampler=sampler, batch_size=8)

    for batch in SamplerWatch(loader): ...                      # or wrap the loader, once, and iterate the watch

Wrapping a sampler compares each epoch's actual order with the previous one's (a digest of
the indices), so it works for any sampler. Wrapping a loader reads its `DistributedSampler`'s
`epoch`/`shuffle`/`seed` at each new iteration (it never iterates the sampler itself, which
would draw from a random sampler's generator). Neither sets anything on the user's objects.
The warning goes to the rank-aware logger (each rank that repeats says so); `strict=True`
raises instead. `repeated_epochs` lists the epochs (0-based) that repeated the previous one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, RandomSampler

from zerodist.utils import get_logger

logger = get_logger(__name__)


class RepeatedEpochError(RuntimeError):
    pass


class SamplerWatch:
    """Wraps a sampler (iterate it to get indices) or a DataLoader (iterate it to get batches)."""

    def __init__(self, sampler_or_loader: Any, *, strict: bool = False, shuffled: bool | None = None):
        self.wrapped = sampler_or_loader
        self.strict = strict
        # Whether each epoch should have a new order: `shuffle` where the sampler says, a
        # RandomSampler always; otherwise (a sequential or unknown sampler) only if told.
        sampler = getattr(sampler_or_loader, "sampler", None) if isinstance(sampler_or_loader, DataLoader) \
            else sampler_or_loader
        self.shuffled = shuffled if shuffled is not None else bool(
            getattr(sampler, "shuffle", isinstance(sampler, RandomSampler)))
        self.epochs_started = 0
        self.repeated_epochs: list[int] = []
        self._previous: Any = None

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epochs_started
        self.epochs_started += 1
        if isinstance(self.wrapped, DataLoader):
            self._check(epoch, self._loader_state(), self._loader_hint())
            return iter(self.wrapped)
        order = list(iter(self.wrapped))
        self._check(epoch, hashlib.sha256(repr(order).encode()).hexdigest(), self._sampler_hint(self.wrapped))
        return iter(order)

    def __len__(self) -> int:
        return len(self.wrapped)

    def set_epoch(self, epoch: int) -> None:
        """Passed on, so code that calls `loader.sampler.set_epoch(epoch)` keeps working."""
        self.wrapped.set_epoch(epoch)

    def _loader_state(self) -> Any:
        """What decides a DistributedSampler's order; None (never compared) for one that does not shuffle."""
        sampler: Any = getattr(self.wrapped, "sampler", None)  # any sampler: duck-typed by its epoch
        if not hasattr(sampler, "epoch"):
            return None
        return (sampler.seed, sampler.epoch) if hasattr(sampler, "seed") else sampler.epoch

    def _loader_hint(self) -> str:
        return self._sampler_hint(getattr(self.wrapped, "sampler", None))

    @staticmethod
    def _sampler_hint(sampler: Any) -> str:
        if hasattr(sampler, "set_epoch") and getattr(sampler, "shuffle", False):
            return (f"{type(sampler).__name__}.epoch is still {getattr(sampler, 'epoch', '?')}: call "
                    "sampler.set_epoch(epoch) before each epoch (the engine's own loader, from "
                    "initialize(training_data=...), does this for you)")
        return "the sampler gives the same order every epoch"

    def _check(self, epoch: int, state: Any, hint: str) -> None:
        repeated = self.shuffled and epoch > 0 and state is not None and state == self._previous
        self._previous = state
        if not repeated:
            return
        self.repeated_epochs.append(epoch)
        message = f"epoch {epoch} starts with the same sample order as epoch {epoch - 1}: {hint}"
        if self.strict:
            raise RepeatedEpochError(message)
        logger.warning("%s", message)
