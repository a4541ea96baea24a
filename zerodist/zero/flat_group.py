"""One planned group of parameters (see plan.py) packed into flat buffers, one allocation per kind.

    param_buffer   all parameters, padded (the module's parameters become views into it); stage 3:
                   only while gathered, taken from and given back to the engine's buffer pool
                   ([Note: buffer pool] in buffer_pool.py), as are the buckets' staging buffers
    param_shard    sharded parameters (stage 3): only this rank's shard of every bucket
    grad_buffer    full gradients (stages 0/1): the full gradient, same layout
    grad_shard     sharded gradients (stages 2/3): only this rank's shard of every bucket
    master         mixed precision: fp32 copy of what this rank's optimizer steps
                   (the full buffer with full optimizer state, this rank's shards otherwise)

What is sharded is the group's `ShardingPolicy`; over which ranks, its `DomainGroup` (the
process group of its parameters' domain). `optimizer_tensors[i]` is what the optimizer steps for
bucket i: a view into `param_buffer` (fp32 training: the master weights *are* the parameters,
no copy) or into `master`. Its gradient is bucket i's reduced gradient.

The module's parameters are re-pointed into `param_buffer` with `param.data = view`, which
changes their storage, not their identity or attributes (no attribute is set on them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.comm.domains import Placement
from zerodist.comm.topology import Domain
from zerodist.zero import sharded_access
from zerodist.zero.bucket import Bucket, GradSyncPlan
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero.layout import FlatLayout, ParamSlot, plan_layout
from zerodist.zero.pending_gather import GatherSlot, PendingGather
from zerodist.zero.policy import DomainGroup, ShardingPolicy
from zerodist.zero.stepped_store import SteppedStore


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """One parameter of a flat group (as FSDP2's `FSDPParam`): the user's parameter object, its
    logical name ([Note: logical names] in zerodist/comm/domains.py), its shape on this rank,
    where it lives in the flat layout, its placement (domain, and how a slice was cut from the
    logical tensor), which part of the logical tensor it is, and (sharded parameters) the
    placeholder its data is while sharded."""

    param: torch.nn.Parameter
    name: str
    shape: tuple[int, ...]
    slot: ParamSlot
    placement: Placement
    part: int = 0  # this rank's index along the placement's slice axis
    num_parts: int = 1
    placeholder: torch.Tensor | None = None

    @property
    def sharded_data(self) -> torch.Tensor:
        """The placeholder (sharded parameters only)."""
        assert self.placeholder is not None, f"{self.name}: a full parameter has no placeholder"
        return self.placeholder

    @property
    def domain(self) -> Domain:
        return self.placement.domain

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The logical tensor's shape: the slice dimension times the number of parts."""
        dim = self.placement.slice_dim
        if dim is None:
            return self.shape
        length = self.placement.logical_size or self.shape[dim] * self.num_parts  # padded parts: the logical length
        return tuple(length if d == dim else n for d, n in enumerate(self.shape))

    def placement_json(self) -> dict[str, Any]:
        """The placement as a checkpoint manifest records it."""
        domain = self.placement.domain
        return {"reduce_axes": list(domain.reduce_axes), "replicated_axes": list(domain.replicated_axes),
                "slice_dim": self.placement.slice_dim, "slice_axis": self.placement.slice_axis,
                "part": self.part, "num_parts": self.num_parts, "fused": list(self.placement.fused),
                "logical_size": self.placement.logical_size}


class FlatParamGroup:
    """Flat buffers, buckets and optimizer tensors for one list of parameters of one domain."""

    # Sharded parameters with the access check on: this group's registered placeholders ([Note:
    # sharded access check] in sharded_access.py); None when the check is off.
    registration: sharded_access.Registration | None = None
    # The post-step all-gather of updated parameters while it is in flight (stages 1/2); see gather_slot.
    gather_slot: GatherSlot | None = None
    gather_blocked_s = 0.0  # time this rank spent blocked waiting for those gathers, all steps
    # Sharded parameters: the all-gathers `start_unshard()` issued, until waited for.
    _unshard_handles: list[comm.CommHandle] = []
    # [Note: stepped values elsewhere] in stepped_store.py: where the optimizer tensors' values live
    # when not in memory; whether the parameter shard left memory too (gathers read it from there),
    # and the full buffer holding this rank's shard, read for the next gather (`prepare_unshard`).
    stepped_store: SteppedStore | None = None
    shard_offloaded = False
    _prepared_buffer: torch.Tensor | None = None

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, policy: ShardingPolicy,
                 domain_group: DomainGroup, bucket_numel: int, use_reduce_scatter: bool, param_dtype: torch.dtype,
                 placements: list[Placement] | None = None, buffer_pool: BufferPool | None = None):
        # Reverse order: backward produces the last parameters' gradients first, so the first
        # buckets fill first and their collectives start while backward goes on.
        params, names = params[::-1], names[::-1]
        placements = placements[::-1] if placements is not None else [Placement(domain_group.domain)] * len(params)
        if any(p.domain != domain_group.domain for p in placements):
            raise ValueError(f"a flat group of domain {domain_group.domain} was given parameters of another domain")
        self.policy, self.domain_group = policy, domain_group
        # Stage 3: where gathered and staging buffers come from and go back to ([Note: buffer pool]);
        # None: torch.empty, and freed when dropped.
        self.buffer_pool = buffer_pool
        self.group, self.rank, self.world_size = domain_group.group, domain_group.rank, domain_group.size
        self.layout: FlatLayout = plan_layout([p.numel() for p in params], bucket_numel=bucket_numel,
                                              world_size=self.world_size)
        self.nans: torch.Tensor | None = None
        self.records = self._make_records(params, names, placements, param_dtype)
        self._norm_ranges = self._ranges_in_norm()
        # Sharded parameters: only this rank's shard is built when the ranks already agree (no full buffer).
        owned = self._initial_shard() if policy.shard_parameters else None
        initial = self._gather_initial_values() if owned is None else owned

        def stepped() -> torch.Tensor:  # what this rank steps, as one tensor (a copy)
            if owned is not None:
                return owned
            return torch.cat([self._stepped_view(initial, i) for i in range(len(self.layout.buckets))])

        self.master = None
        if param_dtype != initial.dtype:
            # Mixed precision: the fp32 master starts from the fp32 values, not from their casts.
            self.master = stepped()
        self.device, self.param_dtype = initial.device, param_dtype
        self.param_shard: torch.Tensor | None = None
        self.param_buffer: torch.Tensor | None = None
        if policy.shard_parameters:
            # Only this rank's shard persists; the full buffer exists between unshard() and reshard().
            self.param_shard = stepped().to(param_dtype)
            self.reshard()
        else:
            self.param_buffer = initial.to(param_dtype)
            self._point_params_at(self.param_buffer)
        self._allocate_gradients(use_reduce_scatter)
        self.buckets = [self._make_bucket(i) for i in range(len(self.layout.buckets))]
        self.optimizer_tensors = self._optimizer_views()

    def _make_records(self, params: list[torch.nn.Parameter], names: list[str], placements: list[Placement],
                      param_dtype: torch.dtype) -> list[ParamRecord]:
        shapes = [tuple(p.shape) for p in params]
        placeholders: Sequence[torch.Tensor | None] = [None] * len(params)
        if self.policy.shard_parameters:
            # Sharded parameters: their data while sharded, made once ([Note: sharded placeholder]).
            self.nans, placeholders = sharded_access.placeholders(shapes, param_dtype, params[0].device)
        return [ParamRecord(p, n, shape, slot, where, *_part_of(where, self.domain_group), placeholder=placeholder)
                for p, n, shape, slot, where, placeholder in zip(params, names, shapes, self.layout.slots, placements,
                                                                  placeholders)]

    def _allocate_gradients(self, use_reduce_scatter: bool) -> None:
        """The gradient buffers the policy asks for, and how buckets sync into them.

        Without sharded optimizer state this is data parallelism as DDP does it: one all-reduce per
        bucket. `reduce_scatter` is a ZeRO 1-3 setting (as in DeepSpeed); with full optimizer state a
        reduce-scatter would need an all-gather after it, and gloo implements reduce-scatter as an
        all-reduce plus copies (1.5x the bytes)."""
        full_grads = not self.policy.shard_gradients
        self.plan = GradSyncPlan(use_reduce_scatter and self.policy.shard_optimizer_state,
                                 persistent_full_grad=full_grads, divisor=self.domain_group.grad_divisor)
        # No zeros in either: each window's first gradients overwrite the full buffer and only what stays
        # unwritten is zeroed ([Note: no gradient memset] in bucket.py); the first sync of each accumulation
        # overwrites the shard (Bucket.accumulated). Untouched pages cost no memory until backward writes them.
        self.grad_buffer = (torch.empty(self.layout.total_numel, dtype=self.param_dtype, device=self.device)
                            if full_grads else None)
        self.grad_shard = None if full_grads else torch.empty(self.layout.shard_numel, dtype=self.param_dtype,
                                                              device=self.device)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters, in layout order."""
        return [r.param for r in self.records]

    @property
    def domain(self) -> Domain:
        return self.domain_group.domain

    def _point_params_at(self, buffer: torch.Tensor) -> None:
        for record in self.records:
            slot = record.slot
            record.param.data = buffer[slot.offset: slot.offset + slot.numel].view_as(record.param)

    # ------------------------------------------------------------------ unshard / reshard
    # One verb for every all-gather of parameters ([Note: one gather verb]):
    #   sharded parameters (stage 3's units): the shards into a transient full buffer, then the
    #   parameters point into it; `reshard()` frees it again.
    #   full parameters, sharded optimizer state (stages 1/2, stage 3's persistent groups): the
    #   updated shards into the persistent full buffer, in place, after each optimizer step;
    #   `reshard()` has nothing to free.
    #   full optimizer state (stage 0): every rank steps the whole buffer; nothing to gather.
    @property
    def is_unsharded(self) -> bool:
        """Whether the parameters point into a full buffer with no gather left to wait for."""
        return self.param_buffer is not None and not self.is_gathering_params and not self._unshard_handles

    def start_unshard(self) -> None:
        """Issue the all-gathers that make the full buffer current (async, one per bucket)."""
        if self.policy.shard_parameters:
            assert self.param_buffer is None and self.param_shard is not None, (
                f"start_unshard on {self.records[0].name}...: already unsharded: {self.param_buffer is not None}")
            if self.shard_offloaded:  # the shard was read into its place in the full buffer: gathered in place
                if self._prepared_buffer is None:
                    self.prepare_unshard()
                self.param_buffer, self._prepared_buffer = self._prepared_buffer, None
            else:
                self.param_buffer = self._transient_buffer(self.layout.total_numel)
            assert self.param_buffer is not None
            source = self.param_buffer if self.shard_offloaded else self.param_shard
            self._unshard_handles = [
                comm.all_gather(self._bucket_range(i, self.param_buffer, owned=False),
                                self._bucket_range(i, source, owned=True) if self.shard_offloaded
                                else self._shard_range(i, source), group=self.group, async_op=True)
                for i in range(len(self.layout.buckets))
            ]
        elif self.gathers_params:
            self._start_gather_in_place()

    def prepare_unshard(self) -> None:
        """An offloaded shard: read it from where it lives straight into its place in the full buffer
        the gather `start_unshard()` issues next fills in place, so in fp32 no other copy of the shard
        is made (a read that fails raises here, before any collective)."""
        buffer = self._transient_buffer(self.layout.total_numel)
        try:
            for index in range(len(self.buckets)):
                self._read_stepped(index, self._bucket_range(index, buffer, owned=True))
        except BaseException:
            self._give_back(buffer)
            raise
        self._prepared_buffer = buffer

    def drop_prepared_unshard(self) -> None:
        """Give back what `prepare_unshard()` read, the gather not issued (a read failed elsewhere)."""
        buffer, self._prepared_buffer = self._prepared_buffer, None
        if buffer is not None:
            self._give_back(buffer)

    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight. Sharded parameters stay placeholders until
        `finish_unshard()` ([Note: early gather] in runtime.py); full ones are current after this."""
        handles, self._unshard_handles = self._unshard_handles, []
        for handle in handles:
            handle.wait()
        self.finish_gather_params()

    def finish_unshard(self) -> None:
        """Wait, then point the parameters at the full buffer."""
        self.wait_unshard()
        if self.policy.shard_parameters:
            assert self.param_buffer is not None, f"finish_unshard on {self.records[0].name}... while sharded"
            if self.registration is not None:
                self.registration.clear()  # first: the access check refuses `param.data = ...` on a registered one
            self._point_params_at(self.param_buffer)

    def unshard(self) -> None:
        """`start_unshard()` and `finish_unshard()`."""
        self.start_unshard()
        self.finish_unshard()

    def reshard(self) -> None:
        """Free the full buffer; parameters become placeholders of their full shape.

        [Note: sharded placeholder] A sharded parameter keeps its full logical shape, so code that
        inspects shapes keeps working (`zerodist.zero.full_shape(p)` says so explicitly), but holds
        no values: its data is one NaN broadcast to the shape (zero strides, no memory), at an
        address of its own (one element of `self.nans`, made once per group). torch does not let
        `param.data` become a meta or subclass tensor, and zerodist never replaces the user's
        parameter objects, so this is the closest a parameter can get to "no data". Using it is
        refused by the access check, which recognises the placeholder (and every alias of it) by
        its address and raises an error naming the parameter ([Note: sharded access check] in
        sharded_access.py). With the check off (`zerodist.debug.sharded_access_check: false`)
        reading gives NaN, never a stale or partial value, and writing in place raises torch's
        own error when the parameter has more than one element (they share one memory location).
        Full parameters (stages 0-2, persistent groups) have nothing to free."""
        if not self.policy.shard_parameters:
            return
        assert self.nans is not None and not self._unshard_handles, "reshard with a gather in flight"
        self.nans.fill_(float("nan"))  # NaN again, should a one-element parameter have been written to
        for record in self.records:
            record.param.data = record.sharded_data
        full, self.param_buffer = self.param_buffer, None
        self._register_placeholders()
        if full is not None:
            self._give_back(full)

    def _give_back(self, buffer: torch.Tensor) -> None:
        if self.buffer_pool is not None:
            self.buffer_pool.give(buffer)  # kept for the next gather or staging buffer, if no one else holds it

    def _transient_buffer(self, numel: int) -> torch.Tensor:
        """A buffer that lives only within a step (a gathered unit, a staging bucket), stale contents."""
        if self.buffer_pool is not None:
            return self.buffer_pool.take(numel, self.param_dtype, self.device)
        return torch.empty(numel, dtype=self.param_dtype, device=self.device)

    def release_pooled_buffers(self) -> None:
        """Free the pool's buffers not in use (the engine is destroyed); the pool is shared by the groups."""
        if self.buffer_pool is not None:
            self.buffer_pool.clear()

    def enable_access_check(self) -> None:
        """Register this group's placeholders with the access check whenever it is sharded,
        until the group is garbage collected."""
        assert self.policy.shard_parameters and self.registration is None
        self.registration = sharded_access.Registration()
        weakref.finalize(self, self.registration.clear)  # the callback holds the registration, not the group
        self._register_placeholders()

    def _register_placeholders(self) -> None:
        if self.registration is not None and self.param_buffer is None:
            for record in self.records:
                self.registration.add(record.sharded_data, record.name)

    def _initial_shard(self) -> torch.Tensor | None:
        """Stage 3: this rank's shards of the initial values, concatenated, built without the full
        flat buffer: a digest of every parameter (in layout order) is compared across ranks first,
        and only if they agree is each parameter's owned part copied and its storage released.
        None when the ranks differ (or on GPU): then rank 0's values are broadcast in full."""
        first = self.records[0].param
        if first.is_cuda:
            return None
        digest = hashlib.blake2b(digest_size=16)
        for record in self.records:
            digest.update(record.slot.offset.to_bytes(8, "little"))
            digest.update(record.param.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
        if not _ranks_agree(digest.digest(), self.group):
            return None
        pieces: list[tuple[int, int, int]] = []  # this rank's range of each bucket, and where it lands in the shard
        start = 0
        for span in self.layout.buckets:
            low = span.shard_offset(self.rank)
            pieces.append((low, low + span.shard_numel, start))
            start += span.shard_numel
        shard = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        for record in self.records:
            flat, slot = record.param.detach().reshape(-1), record.slot
            for low, high, at in pieces:
                begin, end = max(low, slot.offset), min(high, slot.offset + slot.numel)
                if begin < end:
                    shard[at + begin - low: at + end - low].copy_(flat[begin - slot.offset: end - slot.offset])
            record.param.data = record.sharded_data
        return shard

    def _gather_initial_values(self) -> torch.Tensor:
        """The parameters' values in flat layout, identical on every rank (rank 0's win, as in DDP).
        With sharded parameters each parameter's own storage is released as soon as it is copied, so building
        a unit needs about one unit of extra memory, not two."""
        first = self.records[0].param
        buffer = torch.zeros(self.layout.total_numel, dtype=first.dtype, device=first.device)
        for record in self.records:
            slot = record.slot
            buffer[slot.offset: slot.offset + slot.numel].copy_(record.param.detach().reshape(-1))
            if record.placeholder is not None:
                record.param.data = record.placeholder
        _agree_or_broadcast(buffer, self.group)
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
        return self._bucket_range(index, tensor, owned=self.policy.shard_optimizer_state)

    def _make_bucket(self, index: int) -> Bucket:
        if self.grad_buffer is not None:
            grad_full = self._bucket_range(index, self.grad_buffer, owned=False)
            grad_owned = self._bucket_range(index, self.grad_buffer, owned=True)
        else:
            assert self.grad_shard is not None
            grad_full, grad_owned = None, self._shard_range(index, self.grad_shard)
        label = f"bucket {index} of {len(self.layout.buckets)} ({self.records[self.layout.buckets[index].param_indices[0]].name}...)"
        span = self.layout.buckets[index]
        return Bucket(span, plan=self.plan, grad_full=grad_full, grad_owned=grad_owned,
                      group=self.domain_group.grad_group, rank=self.rank, label=label,
                      slots=[self.layout.slots[i] for i in span.param_indices], buffer_pool=self.buffer_pool)

    def _optimizer_views(self) -> list[torch.Tensor]:
        if self.master is None and self.param_shard is not None:
            return [self._shard_range(i, self.param_shard) for i in range(len(self.buckets))]
        if self.master is None:
            assert self.param_buffer is not None
            return [self._stepped_view(self.param_buffer, i) for i in range(len(self.buckets))]
        views, start = [], 0
        for i in range(len(self.buckets)):
            span = self.layout.buckets[i]
            numel = span.shard_numel if self.policy.shard_optimizer_state else span.numel
            views.append(self.master[start: start + numel])
            start += numel
        return views

    def reduced_grad(self, index: int) -> torch.Tensor:
        """Bucket `index`'s reduced gradient, matching `optimizer_tensors[index]`."""
        bucket = self.buckets[index]
        if self.policy.shard_optimizer_state:
            return bucket.grad_owned
        assert bucket.grad_full is not None
        return bucket.grad_full

    def owned_part(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of bucket `index` within an optimizer-space tensor (one shaped like
        `optimizer_tensors[index]`: the whole bucket with full optimizer state, the shard otherwise). The
        pieces it holds are listed, in order, by `layout.owned_slices(rank)` for that bucket."""
        if self.policy.shard_optimizer_state:
            return tensor
        span = self.layout.buckets[index]
        start = span.shard_offset(self.rank) - span.offset
        return tensor[start: start + span.shard_numel]

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
        ranges = []
        for bucket, span in enumerate(self.layout.buckets):
            lo = span.shard_offset(self.rank)
            for index in span.param_indices:
                slot = self.layout.slots[index]
                start, end = max(lo, slot.offset), min(lo + span.shard_numel, slot.offset + slot.numel)
                if self.records[index].placement.in_norm and start < end:
                    ranges.append((bucket, start - lo, end - lo))
        return tuple(ranges)

    def add_grad(self, index: int, grad: torch.Tensor) -> Bucket:
        """Add parameter `index`'s gradient to its bucket (the window's first one overwrites); returns that bucket."""
        bucket = self.buckets[self.layout.slots[index].bucket]
        bucket.write_grad(index, grad)
        return bucket

    def holds_gradients(self) -> bool:
        """Whether any gradient was written or reduced since the last optimizer step."""
        return any(b.holds_gradients for b in self.buckets)

    def copy_master_to_params(self) -> None:
        if self.master is None or self.stepped_store is not None:  # held elsewhere: cast as each piece is stepped
            return
        for i, tensor in enumerate(self.optimizer_tensors):
            if self.param_shard is not None:
                self._shard_range(i, self.param_shard).copy_(tensor)
            else:
                assert self.param_buffer is not None
                self._stepped_view(self.param_buffer, i).copy_(tensor)

    def take_shard_from_full(self) -> None:
        """After the full parameters were changed in place (GatheredParameters with a modifier
        rank): take this rank's shard and master weights from them again."""
        assert self.param_buffer is not None
        for i in range(len(self.buckets)):
            stepped = self._stepped_view(self.param_buffer, i)
            if self.param_shard is not None and not self.shard_offloaded:
                self._shard_range(i, self.param_shard).copy_(stepped)
            if self.stepped_store is not None:
                self.stepped_store.write_values(self.optimizer_tensors[i], 0, stepped)
            elif self.master is not None:
                self.optimizer_tensors[i].copy_(stepped)

    # ------------------------------------------------------------------ stepped values held elsewhere
    def stepped_values(self, index: int) -> torch.Tensor:
        """`optimizer_tensors[index]`'s values: the tensor itself, or a copy read from where they live."""
        tensor = self.optimizer_tensors[index]
        if self.stepped_store is None:
            return tensor
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        self.stepped_store.read_values(tensor, 0, out)
        return out

    def write_stepped(self, index: int, values: torch.Tensor) -> None:
        """Set `optimizer_tensors[index]`'s values (a load); held elsewhere, the parameters get their cast
        at once, otherwise with `copy_master_to_params()`."""
        tensor = self.optimizer_tensors[index]
        if self.stepped_store is None:
            tensor.copy_(values)
            return
        self.stepped_store.write_values(tensor, 0, values)
        self.cast_stepped(index, 0, values)

    def cast_stepped(self, index: int, start: int, values: torch.Tensor) -> None:
        """Mixed precision: new master values of bucket `index` from element `start`, cast into the
        parameters (what `copy_master_to_params` does, one piece at a time)."""
        if self.master is None or self.shard_offloaded:  # fp32, or the shard is read from the master
            return
        if self.param_shard is not None:
            target = self._shard_range(index, self.param_shard)
        else:
            assert self.param_buffer is not None
            target = self._stepped_view(self.param_buffer, index)
        target[start: start + values.numel()].copy_(values)

    def _read_stepped(self, index: int, out: torch.Tensor) -> None:
        """Bucket `index`'s stepped values from the store into `out`, cast to `out`'s dtype."""
        assert self.stepped_store is not None
        tensor = self.optimizer_tensors[index]
        if out.dtype == tensor.dtype:
            self.stepped_store.read_values(tensor, 0, out)
        else:
            out.copy_(self.stepped_values(index))

    def release_stepped(self, store: SteppedStore, shard: bool) -> None:
        """The store holds the stepped values now: the master (and, `shard`, the parameter shard) leave
        memory; each becomes a NaN broadcast to its shape (no memory; never a stale value)."""
        self.stepped_store, self.shard_offloaded = store, shard and self.param_shard is not None
        nan = torch.full((1,), float("nan"), dtype=torch.float32, device=self.device)
        for tensor in self.optimizer_tensors:
            tensor.data = nan.to(tensor.dtype).expand(tensor.numel())
        if self.master is not None:
            self.master.data = nan.expand(self.master.numel())
        if self.shard_offloaded:
            assert self.param_shard is not None
            self.param_shard.data = nan.to(self.param_dtype).expand(self.param_shard.numel())

    @property
    def gathers_params(self) -> bool:
        """Sharded optimizer state, full parameters (stages 1/2, stage 3's persistent groups): each
        rank steps its shards, which an all-gather then brings to every rank."""
        return self.policy.shard_optimizer_state and not self.policy.shard_parameters

    @property
    def pending_gather(self) -> PendingGather | None:
        return None if self.gather_slot is None else self.gather_slot.pending

    @property
    def is_gathering_params(self) -> bool:
        """Whether the last step's gather is still to be waited for (by the group or the access check)."""
        pending = self.pending_gather
        return pending is not None and not pending.done

    def _start_gather_in_place(self) -> None:
        """Issue the all-gathers of every rank's updated shards into the full parameter buffer (async,
        one per bucket, in bucket order). Until `finish_gather_params()` the buffer is being written:
        the access check makes any other reader wait ([Note: parameters being gathered] in
        sharded_access.py)."""
        assert self.param_buffer is not None and self.pending_gather is None, (
            f"start_unshard on {self.records[0].name}...: a gather is already pending")
        handles = [
            comm.all_gather(self._bucket_range(i, self.param_buffer, owned=False),
                            self._bucket_range(i, self.param_buffer, owned=True), group=self.group, async_op=True)
            for i in range(len(self.buckets))
        ]
        if self.gather_slot is None:
            self.gather_slot = GatherSlot()
            # A group dropped with its gather in flight (an engine dropped right after step()) waits for
            # it when collected: its range would otherwise stay registered, and the check on, for good.
            weakref.finalize(self, self.gather_slot.finish)
        self.gather_slot.pending = PendingGather(handles, self.param_buffer)

    def finish_gather_params(self) -> None:
        """Wait for the in-place gather `start_unshard()` issued (full parameters), if any."""
        pending = self.pending_gather
        if pending is not None:
            pending.wait()
            self.gather_blocked_s += pending.blocked_s
            self.gather_slot.pending = None  # type: ignore[union-attr]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state held by this group on this rank, by kind."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        params = size(self.param_shard) if self.policy.shard_parameters else size(self.param_buffer)
        if self.shard_offloaded:
            params = 0
        return {"params": params, "grads": size(self.grad_buffer) + size(self.grad_shard),
                "master": 0 if self.stepped_store is not None else size(self.master)}


def _part_of(placement: Placement, domain_group: DomainGroup) -> tuple[int, int]:
    """(this rank's part, number of parts) of a tensor sliced by `placement`; (0, 1) when whole."""
    if placement.slice_axis is None:
        return 0, 1
    return domain_group.coords[placement.slice_axis], domain_group.degrees[placement.slice_axis]


def _agree_or_broadcast(buffer: torch.Tensor, group: Group) -> None:
    """Make `buffer` equal to the group's first rank's. Ranks built with the same seed already
    agree: compare a digest (16 bytes each) and move the values only if some rank differs."""
    if buffer.is_cuda:
        comm.broadcast(buffer, src=comm.get_global_rank(group, 0), group=group)
        return
    digest = hashlib.blake2b(buffer.view(torch.uint8).numpy().data, digest_size=16).digest()
    if not _ranks_agree(digest, group):
        comm.broadcast(buffer, src=comm.get_global_rank(group, 0), group=group)


def _ranks_agree(digest: bytes, group: Group) -> bool:
    """Whether every rank of `group` holds the same `digest` (one small all-gather)."""
    digests: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(digests, digest, group=group)
    return len(set(digests)) == 1
