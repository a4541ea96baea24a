"""One optimizer param group's parameters packed into flat buffers, one allocation per kind.

    param_buffer   all parameters, padded (the module's parameters become views into it)
    grad_buffer    stages 0/1: the full gradient, same layout
    grad_shard     stage 2: only this rank's shard of every bucket
    master         mixed precision: fp32 copy of what this rank's optimizer steps
                   (the full buffer at stage 0, this rank's shards at stages 1/2)

`optimizer_tensors[i]` is what the optimizer steps for bucket i: a view into `param_buffer`
(fp32 training: the master weights *are* the parameters, no copy) or into `master`. Its
gradient is bucket i's reduced gradient.

The module's parameters are re-pointed into `param_buffer` with `param.data = view`, which
changes their storage, not their identity or attributes (no attribute is set on them).
"""

from __future__ import annotations

from typing import Any

import torch

import zerodist.comm as comm
from zerodist.zero.bucket import Bucket, GradSyncPlan
from zerodist.zero.layout import FlatLayout, plan_layout


class FlatParamGroup:
    """Flat buffers, buckets and optimizer tensors for one list of parameters."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, stage: int, bucket_numel: int,
                 group: Any, rank: int, world_size: int, use_reduce_scatter: bool, param_dtype: torch.dtype):
        # Reverse order: backward produces the last parameters' gradients first, so the first
        # buckets fill first and their collectives start while backward goes on.
        order = list(reversed(range(len(params))))
        self.params = [params[i] for i in order]
        self.names = [names[i] for i in order]
        self.param_shapes = [tuple(p.shape) for p in self.params]
        self.stage, self.rank, self.world_size, self.group = stage, rank, world_size, group
        self.layout: FlatLayout = plan_layout([p.numel() for p in self.params], bucket_numel=bucket_numel,
                                              world_size=world_size)
        initial = self._gather_initial_values()
        self.master = None
        if param_dtype != initial.dtype:
            # Mixed precision: the fp32 master starts from the fp32 values, not from their casts.
            self.master = torch.cat([self._stepped_view(initial, i) for i in range(len(self.layout.buckets))])
        self.param_buffer = initial.to(param_dtype)
        for param, slot in zip(self.params, self.layout.slots):
            param.data = self.param_buffer[slot.offset: slot.offset + slot.numel].view_as(param)
        self.plan = GradSyncPlan(use_reduce_scatter, persistent_full_grad=stage in (0, 1), keep_full_grad=stage == 0)
        dtype, device = self.param_buffer.dtype, self.param_buffer.device
        self.grad_buffer = torch.zeros_like(self.param_buffer) if stage in (0, 1) else None
        self.grad_shard = None if stage in (0, 1) else torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        self.buckets = [self._make_bucket(i) for i in range(len(self.layout.buckets))]
        self.optimizer_tensors = self._optimizer_views()

    def _gather_initial_values(self) -> torch.Tensor:
        """The parameters' values in flat layout, identical on every rank (rank 0's win, as in DDP)."""
        first = self.params[0]
        buffer = torch.zeros(self.layout.total_numel, dtype=first.dtype, device=first.device)
        for param, slot in zip(self.params, self.layout.slots):
            buffer[slot.offset: slot.offset + slot.numel].copy_(param.detach().reshape(-1))
        comm.broadcast(buffer, src=comm.get_global_rank(self.group, 0), group=self.group)
        return buffer

    def _bucket_range(self, index: int, tensor: torch.Tensor, owned: bool) -> torch.Tensor:
        span = self.layout.buckets[index]
        start = span.shard_offset(self.rank) if owned else span.offset
        return tensor[start: start + (span.shard_numel if owned else span.numel)]

    def _shard_range(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Bucket `index`'s piece of a shard-sized tensor (this rank's shards, concatenated)."""
        start = sum(b.shard_numel for b in self.layout.buckets[:index])
        return tensor[start: start + self.layout.buckets[index].shard_numel]

    def _stepped_view(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """What the optimizer steps for bucket `index`, as a view of a full-layout tensor."""
        return self._bucket_range(index, tensor, owned=self.stage > 0)

    def _make_bucket(self, index: int) -> Bucket:
        if self.grad_buffer is not None:
            grad_full = self._bucket_range(index, self.grad_buffer, owned=False)
            grad_owned = self._bucket_range(index, self.grad_buffer, owned=True)
        else:
            assert self.grad_shard is not None
            grad_full, grad_owned = None, self._shard_range(index, self.grad_shard)
        label = f"bucket {index} of {len(self.layout.buckets)} ({self.names[self.layout.buckets[index].param_indices[0]]}...)"
        return Bucket(self.layout.buckets[index], plan=self.plan, grad_full=grad_full, grad_owned=grad_owned,
                      group=self.group, rank=self.rank, label=label)

    def _optimizer_views(self) -> list[torch.Tensor]:
        if self.master is None:
            return [self._stepped_view(self.param_buffer, i) for i in range(len(self.buckets))]
        views, start = [], 0
        for i in range(len(self.buckets)):
            numel = self._stepped_view(self.param_buffer, i).numel()
            views.append(self.master[start: start + numel])
            start += numel
        return views

    def reduced_grad(self, index: int) -> torch.Tensor:
        """Bucket `index`'s reduced gradient, matching `optimizer_tensors[index]`."""
        bucket = self.buckets[index]
        if self.stage == 0:
            assert bucket.grad_full is not None
            return bucket.grad_full
        return bucket.grad_owned

    def owned_part(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of bucket `index` within an optimizer-space tensor (one shaped like
        `optimizer_tensors[index]`: the whole bucket at stage 0, the shard otherwise). The
        pieces it holds are listed, in order, by `layout.owned_slices(rank)` for that bucket."""
        if self.stage != 0:
            return tensor
        span = self.layout.buckets[index]
        start = span.shard_offset(self.rank) - span.offset
        return tensor[start: start + span.shard_numel]

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard of every bucket's reduced gradient: disjoint across ranks."""
        return [b.grad_owned for b in self.buckets]

    def add_grad(self, index: int, grad: torch.Tensor) -> Bucket:
        """Add parameter `index`'s gradient to its bucket; returns that bucket."""
        slot = self.layout.slots[index]
        bucket = self.buckets[slot.bucket]
        start = slot.offset - bucket.span.offset
        bucket.grad_target()[start: start + slot.numel].add_(grad.reshape(-1))
        return bucket

    def copy_master_to_params(self) -> None:
        if self.master is None:
            return
        for i, tensor in enumerate(self.optimizer_tensors):
            self._stepped_view(self.param_buffer, i).copy_(tensor)

    def gather_params(self) -> None:
        """Stages 1/2: every rank's updated shards back into the full parameter buffer."""
        if self.stage == 0:
            return
        handles = [
            comm.all_gather(self._bucket_range(i, self.param_buffer, owned=False),
                            self._bucket_range(i, self.param_buffer, owned=True), group=self.group, async_op=True)
            for i in range(len(self.buckets))
        ]
        for handle in handles:
            handle.wait()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state held by this group on this rank, by kind."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        return {"params": size(self.param_buffer), "grads": size(self.grad_buffer) + size(self.grad_shard),
                "master": size(self.master)}
