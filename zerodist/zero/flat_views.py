"""Views of a flat group's tensors by bucket (principle 3: the layout is pure, then views into one allocation).

A flat group's tensors come in two sizes: full-layout ones (`total_numel`: the parameter buffer,
the full gradient buffer) and shard-sized ones (`shard_numel`: this rank's shard of every bucket,
concatenated: the parameter shard, the gradient shard). `FlatViews` cuts bucket `index` out of
either, and says which of the two the optimizer steps (its shard with sharded optimizer state,
the whole bucket otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from zerodist.zero.layout import FlatLayout


@dataclasses.dataclass(frozen=True)
class FlatViews:
    """Bucket views for one flat group on one rank."""

    layout: FlatLayout
    rank: int  # this rank's index in the group's domain group
    sharded_steps: bool  # the optimizer steps this rank's shard of each bucket (sharded optimizer state)

    @property
    def num_buckets(self) -> int:
        return len(self.layout.buckets)

    def bucket(self, index: int, tensor: torch.Tensor, owned: bool) -> torch.Tensor:
        """Bucket `index` of a full-layout tensor: the whole bucket, or this rank's shard of it (`owned`)."""
        span = self.layout.buckets[index]
        start = span.shard_offset(self.rank) if owned else span.offset
        return tensor[start: start + (span.shard_numel if owned else span.numel)]

    def shard(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Bucket `index`'s piece of a shard-sized tensor (this rank's shards, concatenated)."""
        start = self._shard_starts[index]
        return tensor[start: start + self.layout.buckets[index].shard_numel]

    def stepped(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """What the optimizer steps for bucket `index`, as a view of a full-layout tensor."""
        return self.bucket(index, tensor, owned=self.sharded_steps)

    def stepped_numel(self, index: int) -> int:
        span = self.layout.buckets[index]
        return span.shard_numel if self.sharded_steps else span.numel

    @functools.cached_property  # frozen: cached_property writes the instance dict, not through setattr
    def _shard_starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((b.shard_numel for b in self.layout.buckets), initial=0))
