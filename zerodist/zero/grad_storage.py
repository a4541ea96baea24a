"""Where a flat group's gradients live: the buffers the sharding policy asks for and their buckets.

    grad_buffer    full gradients (stages 0/1): the full gradient, in the parameters' flat layout
    grad_shard     sharded gradients (stages 2/3): only this rank's shard of every bucket

Each `Bucket` (bucket.py) holds views into one of them and runs its own lifecycle
(`register_grad_ready -> start_grad_sync -> finish_grad_sync -> reset`). Which collective a bucket
syncs with is decided once, in `ZeroSettings.from_config` (apply.py); the divisor is the domain's.
"""

from __future__ import annotations

import torch

from zerodist.zero.bucket import Bucket, GradSyncPlan
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero.flat_views import FlatViews
from zerodist.zero.param_storage import ParamRecord
from zerodist.zero.policy import DomainGroup, ShardingPolicy


class GradStorage:
    """The gradient buffers of one flat group, its buckets, and the owned gradients the step reads."""

    grad_buffer: torch.Tensor | None  # full gradients (stages 0/1)
    grad_shard: torch.Tensor | None  # sharded gradients (stages 2/3)

    def __init__(self, records: list[ParamRecord], views: FlatViews, *, policy: ShardingPolicy,
                 domain_group: DomainGroup, use_reduce_scatter: bool, dtype: torch.dtype, device: torch.device,
                 buffer_pool: BufferPool | None, trainable: bool = True):
        # A reduce-scatter leaves only this rank's shard reduced: the optimizer must step shards.
        assert policy.shard_optimizer_state or not use_reduce_scatter, (
            "reduce-scatter with full optimizer state (resolved in ZeroSettings.from_config: stage 0 all-reduces)")
        self.records, self.views, self.sharded_steps = records, views, policy.shard_optimizer_state
        full_grads = not policy.shard_gradients
        self.plan = GradSyncPlan(use_reduce_scatter, persistent_full_grad=full_grads, divisor=domain_group.grad_divisor,
                                 replica_group=domain_group.replica_group, comm_dtype=domain_group.grad_comm_dtype,
                                 quantized=domain_group.quantized_grads)
        # No zeros in either: each window's first gradients overwrite the full buffer and only what stays
        # unwritten is zeroed ([Note: no gradient memset] in bucket.py); the first sync of each accumulation
        # overwrites the shard (Bucket.accumulated). Untouched pages cost no memory until backward writes them.
        # A frozen group's parameters take no gradient: no buffer, no bucket ([Note: frozen parameters at stage 3]).
        layout = views.layout
        self.grad_buffer = torch.empty(layout.total_numel, dtype=dtype, device=device) \
            if full_grads and trainable else None
        self.grad_shard = torch.empty(layout.shard_numel, dtype=dtype, device=device) \
            if not full_grads and trainable else None
        self.buckets = [self._make_bucket(i, domain_group, buffer_pool) for i in range(views.num_buckets)] \
            if trainable else []
        self._norm_ranges = self._ranges_in_norm()

    def _make_bucket(self, index: int, domain_group: DomainGroup, buffer_pool: BufferPool | None) -> Bucket:
        views, layout = self.views, self.views.layout
        if self.grad_buffer is not None:
            grad_full = views.bucket(index, self.grad_buffer, owned=False)
            grad_owned = views.bucket(index, self.grad_buffer, owned=True)
        else:
            assert self.grad_shard is not None
            grad_full, grad_owned = None, views.shard(index, self.grad_shard)
        span = layout.buckets[index]
        label = f"bucket {index} of {len(layout.buckets)} ({self.records[span.param_indices[0]].name}...)"
        return Bucket(span, plan=self.plan, grad_full=grad_full, grad_owned=grad_owned,
                      group=domain_group.grad_group, rank=views.rank, label=label,
                      slots=[layout.slots[i] for i in span.param_indices], buffer_pool=buffer_pool)

    def reduced_grad(self, index: int) -> torch.Tensor:
        """Bucket `index`'s reduced gradient, matching what the optimizer steps for it."""
        bucket = self.buckets[index]
        if self.sharded_steps:
            return bucket.grad_owned
        assert bucket.grad_full is not None
        return bucket.grad_full

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard of every bucket's reduced gradient: disjoint across ranks."""
        return [b.grad_owned for b in self.buckets]

    def norm_grads(self) -> list[torch.Tensor]:
        """What this rank adds to the global gradient norm of its owned gradients: all of them, less
        the parameters another rank counts ([Note: copies counted elsewhere] in zerodist/comm/domains.py)."""
        owned = self.owned_grads()
        if self._norm_ranges is None:
            return owned
        return [owned[bucket][start:end] for bucket, start, end in self._norm_ranges]

    def _ranges_in_norm(self) -> tuple[tuple[int, int, int], ...] | None:
        """(bucket, start, end) of the owned gradient pieces of the parameters this rank counts in
        the norm, within each bucket's owned shard; None when it counts every parameter."""
        if all(record.placement.in_norm for record in self.records):
            return None
        layout, ranges = self.views.layout, []
        for bucket, span in enumerate(layout.buckets):
            lo = span.shard_offset(self.views.rank)
            for index in span.param_indices:
                slot = layout.slots[index]
                start, end = max(lo, slot.offset), min(lo + span.shard_numel, slot.offset + slot.numel)
                if self.records[index].placement.in_norm and start < end:
                    ranges.append((bucket, start - lo, end - lo))
        return tuple(ranges)

    def add_grad(self, index: int, grad: torch.Tensor) -> Bucket:
        """Add parameter `index`'s gradient to its bucket (the window's first one overwrites); returns that bucket."""
        bucket = self.buckets[self.views.layout.slots[index].bucket]
        bucket.write_grad(index, grad)
        return bucket

    def holds_gradients(self) -> bool:
        """Whether any gradient was written or reduced since the last optimizer step."""
        return any(b.holds_gradients for b in self.buckets)

    def grads_bytes(self) -> int:
        return sum(0 if t is None else t.numel() * t.element_size() for t in (self.grad_buffer, self.grad_shard))
