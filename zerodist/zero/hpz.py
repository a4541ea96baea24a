"""hpZ (ZeRO++'s hierarchical partitioning, `zero_optimization.zero_hpz_partition_size: k`): a
secondary copy of a sharded group's parameters, sharded within the node.

[Note: secondary partition] A stage-3 group's primary shards are spread over all D ranks of its
domain, so gathering them crosses nodes. When a gather from the primary shards lands with grad
mode on (a training forward: a backward will gather the unit again), each rank also keeps the
1/k slice of every gathered bucket that its index within its block of k consecutive ranks (its
node, with k = ranks per node) stands for: Ψ/k elements, from the pool ([Note: buffer pool]). The
unit's next gather (the backward's re-gather, or the next forward under accumulation before the
optimizer step) all-gathers those slices within the block instead, and hands the copy back: the
gather never leaves the node. The copy is one-shot, and dropped whenever the shards may change: before every
optimizer step (`UnitRuntime.before_step`), when stepped values are cast into the shards or a
checkpoint is loaded (`copy_master_to_params`, `stepped_target`), and when a modifier of
`GatheredParameters` writes them (`take_shard_from_full`), so a stale copy is never read
(tests/zero/test_zeropp.py loads a checkpoint between a forward and the next). The values are the gathered ones
bit for bit, so hpZ changes no number: it is bitwise equal to plain ZeRO-3
(tests/zero/test_zeropp.py).

Cost: Ψ/k more elements per rank between a unit's forward and its backward, a copy of Ψ/k
elements per gathered unit; saved: the backward's cross-node all-gather (Ψ (D-1)/D bus bytes per
rank become Ψ (k-1)/k within the node).
"""

from __future__ import annotations

import torch

import zerodist.comm as comm
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero.flat_views import FlatViews
from zerodist.zero.policy import SecondaryGroup


class SecondaryCopy:
    """One sharded group's secondary partition ([Note: secondary partition])."""

    def __init__(self, views: FlatViews, where: SecondaryGroup, buffer_pool: BufferPool | None):
        self.views, self.where, self.buffer_pool = views, where, buffer_pool
        layout = views.layout
        for span in layout.buckets:
            assert span.numel % where.size == 0, f"a bucket of {span.numel} elements in {where.size} secondary shards"
        self.numel = layout.total_numel // where.size
        self.held: torch.Tensor | None = None  # the copy, between its gather from the primary shards and its use
        self.in_flight: torch.Tensor | None = None  # the copy a secondary gather reads, until waited for

    def _piece(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        span = self.views.layout.buckets[index]
        size = span.numel // self.where.size
        return tensor[span.offset // self.where.size: span.offset // self.where.size + size]

    def keep(self, full: torch.Tensor) -> None:
        """Copy this rank's secondary slice of every bucket out of a freshly gathered full buffer."""
        if self.held is None:
            self.held = (self.buffer_pool.take(self.numel, full.dtype, full.device) if self.buffer_pool is not None
                         else torch.empty(self.numel, dtype=full.dtype, device=full.device))
        k, j = self.where.size, self.where.index
        for i in range(self.views.num_buckets):
            bucket = self.views.bucket(i, full, owned=False)
            size = bucket.numel() // k
            self._piece(self.held, i).copy_(bucket[j * size: (j + 1) * size])

    def gather(self, full: torch.Tensor) -> list[comm.CommHandle]:
        """All-gather the held copy within the block into `full` (async, one per bucket); the copy is used up."""
        held, self.held = self.held, None
        assert held is not None
        self.in_flight = held
        return [comm.all_gather(self.views.bucket(i, full, owned=False), self._piece(held, i),
                                group=self.where.group, async_op=True)
                for i in range(self.views.num_buckets)]

    def landed(self) -> None:
        """The secondary gather was waited for: its copy goes back to the pool."""
        self._give(self.in_flight)
        self.in_flight = None

    def drop(self) -> None:
        """The primary shards are about to change (or were changed): the copy is stale."""
        held, self.held = self.held, None
        self._give(held)

    def _give(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None and self.buffer_pool is not None:
            self.buffer_pool.give(tensor)
