"""Where a flat group's parameters live, and their lifecycle (principle 2: an explicit state enum).

Two storages, one per way a group's parameters are held, chosen once from the sharding policy
(as FSDP2's `FSDPParam` holds `ShardedState`); both answer the same verbs, so the unit runtime
calls one `unshard` whatever the stage ([Note: one gather verb] in runtime.py):

    ShardedParams (stage 3's units)  only this rank's shard persists; the full buffer exists
        between unshard and reshard, taken from and given back to the buffer pool
            SHARDED --start_unshard()--> UNSHARDING --wait_unshard()--> GATHERED
                    --finish_unshard()--> UNSHARDED --reshard()--> SHARDED
        (GATHERED: the all-gathers landed, the parameters are still placeholders: [Note: early
        gather] in runtime.py; reshard() frees from GATHERED or UNSHARDED, never mid-gather)
    FullParams (stages 0-2, stage 3's persistent groups)  the full buffer persists
            UNSHARDED --start_unshard()--> UNSHARDING --wait_unshard()--> UNSHARDED
        (with sharded optimizer state, the post-step all-gather of every rank's updated shards
        into the buffer, in place: [Note: overlapped parameter gather] in runtime.py; with full
        optimizer state there is nothing to gather and the state never leaves UNSHARDED)

Transitions are guarded by assertions that name the group and print its counts.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.comm.domains import Placement
from zerodist.comm.quantized import quantized_all_gather_start
from zerodist.comm.topology import Domain
from zerodist.zero import sharded_access
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero.flat_views import FlatViews
from zerodist.zero.hpz import SecondaryCopy
from zerodist.zero.layout import ParamSlot
from zerodist.zero.pending_gather import GatherSlot, PendingGather
from zerodist.zero.policy import DomainGroup, SecondaryGroup


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


def make_records(params: Sequence[torch.nn.Parameter], names: Sequence[str], placements: Sequence[Placement],
                 slots: Sequence[ParamSlot], domain_group: DomainGroup,
                 placeholders: Sequence[torch.Tensor | None]) -> list[ParamRecord]:
    return [ParamRecord(p, n, tuple(p.shape), slot, where, *_part_of(where, domain_group), placeholder=placeholder)
            for p, n, slot, where, placeholder in zip(params, names, slots, placements, placeholders)]


def _part_of(placement: Placement, domain_group: DomainGroup) -> tuple[int, int]:
    """(this rank's part, number of parts) of a tensor sliced by `placement`; (0, 1) when whole."""
    if placement.slice_axis is None:
        return 0, 1
    return domain_group.coords[placement.slice_axis], domain_group.degrees[placement.slice_axis]


class ParamState(enum.Enum):
    SHARDED = "sharded"  # placeholders; only this rank's shard is held
    UNSHARDING = "unsharding"  # all-gathers into the full buffer in flight
    GATHERED = "gathered"  # sharded parameters: the gathers landed, parameters still placeholders
    UNSHARDED = "unsharded"  # the parameters point into the full buffer


class ParamStorage(abc.ABC):
    """What both storages share: the records, the views, where buffers come from."""

    state: ParamState
    param_buffer: torch.Tensor | None = None  # the full buffer the parameters point into, while it exists
    param_shard: torch.Tensor | None = None  # sharded parameters: this rank's shard of every bucket
    # Sharded parameters with the access check on ([Note: sharded access check] in sharded_access.py).
    registration: sharded_access.Registration | None = None
    shard_offloaded = False  # the shard lives in a SteppedStore ([Note: stepped values elsewhere])
    # Full parameters: the post-step all-gather while in flight, and the time this rank was blocked on it.
    gather_slot: GatherSlot | None = None
    gather_blocked_s = 0.0

    def __init__(self, records: list[ParamRecord], views: FlatViews, *, group: Group, dtype: torch.dtype,
                 device: torch.device, buffer_pool: BufferPool | None):
        self.records, self.views, self.group = records, views, group
        self.dtype, self.device = dtype, device
        # Stage 3: where gathered buffers come from and go back to ([Note: buffer pool] in buffer_pool.py);
        # None: torch.empty, and freed when dropped.
        self.buffer_pool = buffer_pool

    def _point_params_at(self, buffer: torch.Tensor) -> None:
        for record in self.records:
            slot = record.slot
            record.param.data = buffer[slot.offset: slot.offset + slot.numel].view_as(record.param)

    def _all_gather(self, source: Callable[[int], torch.Tensor]) -> list[comm.CommHandle]:
        """Every rank's bucket shards into the full buffer (async, one per bucket, in bucket order)."""
        assert self.param_buffer is not None
        return [comm.all_gather(self.views.bucket(i, self.param_buffer, owned=False), source(i), group=self.group,
                                async_op=True)
                for i in range(self.views.num_buckets)]

    def _describe(self, verb: str, in_flight: int) -> str:
        return (f"{verb} on {self.records[0].name}... ({len(self.records)} parameters, {self.views.num_buckets} "
                f"buckets): state {self.state.value}, {in_flight} all-gathers in flight, full buffer "
                f"{'held' if self.param_buffer is not None else 'freed'}")

    # The verbs (principle 2), each storage's own: see the module's docstring for the transitions.
    @property
    @abc.abstractmethod
    def is_unsharded(self) -> bool:
        """Whether the parameters' full values are in the full buffer with no gather left to wait for."""

    @abc.abstractmethod
    def start_unshard(self) -> None:
        """Issue the all-gathers that make the full buffer current (async, one per bucket)."""

    @abc.abstractmethod
    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight."""

    @abc.abstractmethod
    def finish_unshard(self) -> None:
        """Wait, then the parameters point into the full buffer."""

    @abc.abstractmethod
    def reshard(self) -> None:
        """Free what the full values need (sharded parameters); nothing otherwise."""

    def drop_secondary(self) -> None:
        """hpZ's secondary copy is stale (sharded parameters only: hpz.py)."""

    @abc.abstractmethod
    def take_shard_from_full(self) -> None:
        """After the full parameters were changed in place: what this rank holds of them, again."""

    @abc.abstractmethod
    def stepped_target(self, index: int) -> torch.Tensor:
        """Where bucket `index`'s stepped values land in the parameters (the shard, or the full buffer)."""

    @abc.abstractmethod
    def params_bytes(self) -> int:
        """Bytes of parameters this storage holds in memory on this rank."""


class ShardedParams(ParamStorage):
    """Sharded parameters: this rank's shard persists, the full buffer is transient."""

    _read_stepped: Callable[[int, torch.Tensor], None] | None = None  # offloaded: reads a bucket's shard
    _prepared_buffer: torch.Tensor | None = None  # offloaded: the shard read into its place, for the next gather

    def __init__(self, records: list[ParamRecord], views: FlatViews, *, shard: torch.Tensor, nans: torch.Tensor,
                 group: Group, buffer_pool: BufferPool | None, secondary: SecondaryGroup | None = None,
                 weight_bits: int | None = None):
        super().__init__(records, views, group=group, dtype=shard.dtype, device=shard.device, buffer_pool=buffer_pool)
        self.param_shard, self.nans = shard, nans
        # hpZ: the secondary partition within the node ([Note: secondary partition] in hpz.py)
        self.secondary = None if secondary is None else SecondaryCopy(views, secondary, buffer_pool)
        self._from_primary = False  # the gather in flight reads the primary shards
        self.weight_bits = weight_bits  # qwZ: the primary gathers are quantized to this many bits
        self._handles: list[comm.CommHandle] = []  # the all-gathers `start_unshard()` issued, until waited for
        self.state = ParamState.UNSHARDED  # the parameters' own storage until now; reshard() makes them placeholders
        self.reshard()

    @property
    def is_unsharded(self) -> bool:
        return self.state in (ParamState.GATHERED, ParamState.UNSHARDED)

    def start_unshard(self) -> None:
        """Issue the all-gathers of the shards into a transient full buffer (async, one per bucket)."""
        assert self.state is ParamState.SHARDED, self._describe("start_unshard", len(self._handles))
        shard = self.param_shard
        assert shard is not None
        if self.shard_offloaded:  # the shard was read into its place in the full buffer: gathered in place
            if self._prepared_buffer is None:
                self.prepare_unshard()
            self.param_buffer, self._prepared_buffer = self._prepared_buffer, None
            full = self.param_buffer
            assert full is not None
            self._handles = self._gather_primary(lambda i: self.views.bucket(i, full, owned=True))
        elif self.secondary is not None and self.secondary.held is not None:  # hpZ: within the node
            self.param_buffer = self._transient_buffer()
            self._handles, self._from_primary = self.secondary.gather(self.param_buffer), False
        else:
            self.param_buffer = self._transient_buffer()
            self._handles, self._from_primary = self._gather_primary(lambda i: self.views.shard(i, shard)), True
        self.state = ParamState.UNSHARDING

    def _gather_primary(self, source: Callable[[int], torch.Tensor]) -> list[comm.CommHandle]:
        """Every rank's bucket shards into the full buffer, quantized with qwZ (every rank, the owner
        included, then holds the same dequantized values; the shard itself stays exact)."""
        if self.weight_bits is None:
            return self._all_gather(source)
        full = self.param_buffer
        assert full is not None
        return [quantized_all_gather_start(source(i), self.group, self.weight_bits,
                                           out=self.views.bucket(i, full, owned=False))
                for i in range(self.views.num_buckets)]

    def prepare_unshard(self) -> None:
        """An offloaded shard: read it from where it lives straight into its place in the full buffer
        the gather `start_unshard()` issues next fills in place, so in fp32 no other copy of the shard
        is made (a read that fails raises here, before any collective)."""
        assert self._read_stepped is not None, self._describe("prepare_unshard of a shard held in memory", 0)
        buffer = self._transient_buffer()
        try:
            for index in range(self.views.num_buckets):
                self._read_stepped(index, self.views.bucket(index, buffer, owned=True))
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
        """Wait for the all-gathers in flight; the parameters stay placeholders until `finish_unshard()`."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()
        if self.state is ParamState.UNSHARDING:
            self.state = ParamState.GATHERED
            if self.secondary is not None:
                self.secondary.landed()
                # a training forward's gather: the backward will gather this group again, within the node
                if self._from_primary and torch.is_grad_enabled() and self.param_buffer is not None:
                    self.secondary.keep(self.param_buffer)

    def finish_unshard(self) -> None:
        """Wait, then point the parameters at the full buffer."""
        self.wait_unshard()
        assert self.state in (ParamState.GATHERED, ParamState.UNSHARDED) and self.param_buffer is not None, (
            self._describe("finish_unshard", 0))
        if self.registration is not None:
            self.registration.clear()  # first: the access check refuses `param.data = ...` on a registered one
        self._point_params_at(self.param_buffer)
        self.state = ParamState.UNSHARDED

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
        own error when the parameter has more than one element (they share one memory location)."""
        assert self.state is not ParamState.UNSHARDING and not self._handles, (
            self._describe("reshard with a gather in flight:", len(self._handles)))
        self.nans.fill_(float("nan"))  # NaN again, should a one-element parameter have been written to
        for record in self.records:
            record.param.data = record.sharded_data
        full, self.param_buffer = self.param_buffer, None
        self.state = ParamState.SHARDED
        self._register_placeholders()
        if full is not None:
            self._give_back(full)

    def _give_back(self, buffer: torch.Tensor) -> None:
        if self.buffer_pool is not None:
            self.buffer_pool.give(buffer)  # kept for the next gather or staging buffer, if no one else holds it

    def _transient_buffer(self) -> torch.Tensor:
        """A full buffer that lives only within a step (a gathered unit), stale contents."""
        numel = self.views.layout.total_numel
        if self.buffer_pool is not None:
            return self.buffer_pool.take(numel, self.dtype, self.device)
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def enable_access_check(self) -> None:
        """Register the placeholders with the access check whenever sharded, until this is garbage collected."""
        assert self.registration is None, self._describe("enable_access_check twice", len(self._handles))
        self.registration = sharded_access.Registration()
        weakref.finalize(self, self.registration.clear)  # the callback holds the registration, not the storage
        self._register_placeholders()

    def _register_placeholders(self) -> None:
        if self.registration is not None and self.param_buffer is None:
            for record in self.records:
                self.registration.add(record.sharded_data, record.name)

    def offload_shard(self, read: Callable[[int, torch.Tensor], None]) -> None:
        """The shard leaves memory (a NaN broadcast to its shape); `read(index, out)` brings bucket
        `index`'s shard back into `out` for each gather ([Note: stepped values elsewhere])."""
        assert self.param_shard is not None
        self.shard_offloaded, self._read_stepped = True, read
        nan = torch.full((1,), float("nan"), dtype=torch.float32, device=self.device)
        self.param_shard.data = nan.to(self.dtype).expand(self.param_shard.numel())

    def stepped_target(self, index: int) -> torch.Tensor:
        assert self.param_shard is not None
        self.drop_secondary()  # whoever writes here (a step's cast, a checkpoint's load) changes the shard
        return self.views.shard(index, self.param_shard)

    def drop_secondary(self) -> None:
        """The shards are about to change: hpZ's secondary copy is stale ([Note: secondary partition])."""
        if self.secondary is not None:
            self.secondary.drop()

    def take_shard_from_full(self) -> None:
        """After the full parameters were changed in place: this rank's shard from them again."""
        assert self.param_buffer is not None and self.param_shard is not None, self._describe("take_shard_from_full", 0)
        self.drop_secondary()
        if self.shard_offloaded:
            return
        for i in range(self.views.num_buckets):
            self.views.shard(i, self.param_shard).copy_(self.views.stepped(i, self.param_buffer))

    def params_bytes(self) -> int:
        shard = self.param_shard
        return 0 if self.shard_offloaded or shard is None else shard.numel() * shard.element_size()


class FullParams(ParamStorage):
    """Full parameters: the buffer persists; with sharded optimizer state, every step's updated shards
    are all-gathered into it in place."""

    def __init__(self, records: list[ParamRecord], views: FlatViews, *, buffer: torch.Tensor, gathers: bool,
                 group: Group):
        super().__init__(records, views, group=group, dtype=buffer.dtype, device=buffer.device, buffer_pool=None)
        self.param_buffer, self.gathers = buffer, gathers
        self._point_params_at(buffer)
        self.state = ParamState.UNSHARDED

    @property
    def pending_gather(self) -> PendingGather | None:
        return None if self.gather_slot is None else self.gather_slot.pending

    @property
    def is_gathering(self) -> bool:
        """Whether the last step's gather is still to be waited for (by the group or the access check)."""
        pending = self.pending_gather
        return pending is not None and not pending.done

    @property
    def is_unsharded(self) -> bool:
        return not self.is_gathering

    def start_unshard(self) -> None:
        """Issue the all-gathers of every rank's updated shards into the full buffer (async, one per
        bucket, in bucket order); nothing with full optimizer state. Until `wait_unshard()` the buffer
        is being written: the access check makes any other reader wait ([Note: parameters being
        gathered] in sharded_access.py)."""
        if not self.gathers:
            return
        assert self.state is ParamState.UNSHARDED and self.pending_gather is None, (
            self._describe("start_unshard: a gather is already pending;", self.views.num_buckets))
        buffer = self.param_buffer
        assert buffer is not None
        handles = self._all_gather(lambda i: self.views.bucket(i, buffer, owned=True))
        if self.gather_slot is None:
            self.gather_slot = GatherSlot()
            # A group dropped with its gather in flight (an engine dropped right after step()) waits for
            # it when collected: its range would otherwise stay registered, and the check on, for good.
            weakref.finalize(self, self.gather_slot.finish)
        self.gather_slot.pending = PendingGather(handles, buffer)
        self.state = ParamState.UNSHARDING

    def wait_unshard(self) -> None:
        """Wait for the in-place gather `start_unshard()` issued, if any: the parameters are current."""
        pending = self.pending_gather
        if pending is not None:
            pending.wait()
            self.gather_blocked_s += pending.blocked_s
            self.gather_slot.pending = None  # type: ignore[union-attr]
        self.state = ParamState.UNSHARDED

    def finish_unshard(self) -> None:
        """The parameters always point into the full buffer: only wait."""
        self.wait_unshard()

    def reshard(self) -> None:
        """Full parameters have nothing to free."""

    def stepped_target(self, index: int) -> torch.Tensor:
        assert self.param_buffer is not None
        return self.views.stepped(index, self.param_buffer)

    def take_shard_from_full(self) -> None:
        """The full buffer is the parameters: nothing to take."""

    def params_bytes(self) -> int:
        buffer = self.param_buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()
