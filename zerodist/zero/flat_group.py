"""One planned group of parameters (see plan.py) packed into flat buffers, one allocation per kind.

`FlatParamGroup` composes one object per concern, each in its own module:

    records        param_storage.py   one `ParamRecord` per parameter (name, slot, placement)
    storage        param_storage.py   where the parameters live and their `ParamState` lifecycle:
                                      `ShardedParams` (stage 3's units: `param_shard` persists, the
                                      full `param_buffer` only while gathered, from the buffer pool)
                                      or `FullParams` (the full `param_buffer` persists; with sharded
                                      optimizer state it is all-gathered in place after each step)
    grads          grad_storage.py    `grad_buffer` (stages 0/1) or `grad_shard` (stages 2/3), the buckets
    optimizer      optimizer_view.py  what this rank steps: `optimizer_tensors`, the fp32 `master`
                                      (mixed precision), the store they may live in
    initial values initial_values.py  equal on every rank of the domain group before anything is built

What is sharded is the group's `ShardingPolicy`; over which ranks, its `DomainGroup` (the
process group of its parameters' domain). `optimizer_tensors[i]` is what the optimizer steps for
bucket i; its gradient is `reduced_grad(i)`.

The module's parameters are re-pointed into `param_buffer` with `param.data = view`, which
changes their storage, not their identity or attributes (no attribute is set on them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerodist.comm.domains import Placement
from zerodist.comm.topology import Domain
from zerodist.zero import sharded_access
from zerodist.zero.bucket import Bucket
from zerodist.zero.buffer_pool import BufferPool
from zerodist.zero.flat_views import FlatViews
from zerodist.zero.grad_storage import GradStorage
from zerodist.zero.initial_values import gather_initial_values, initial_shard
from zerodist.zero.layout import FlatLayout, plan_layout
from zerodist.zero.optimizer_view import OptimizerView
from zerodist.zero.param_storage import FullParams, ParamRecord, ParamState, ParamStorage, ShardedParams, make_records
from zerodist.zero.pending_gather import GatherSlot, PendingGather
from zerodist.zero.policy import DomainGroup, ShardingPolicy
from zerodist.zero.stepped_store import SteppedStore

__all__ = ["FlatParamGroup", "GatherSlot", "ParamRecord", "ParamState", "PendingGather"]


class FlatParamGroup:
    """Flat buffers, buckets and optimizer tensors for one list of parameters of one domain."""

    storage: ParamStorage
    grads: GradStorage
    optimizer: OptimizerView

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, policy: ShardingPolicy,
                 domain_group: DomainGroup, bucket_numel: int, use_reduce_scatter: bool, param_dtype: torch.dtype,
                 placements: list[Placement] | None = None, buffer_pool: BufferPool | None = None,
                 keep_master: bool = True, trainable: bool = True):
        # Reverse order: backward produces the last parameters' gradients first, so the first
        # buckets fill first and their collectives start while backward goes on.
        params, names = params[::-1], names[::-1]
        placements = placements[::-1] if placements is not None else [Placement(domain_group.domain)] * len(params)
        if any(p.domain != domain_group.domain for p in placements):
            raise ValueError(f"a flat group of domain {domain_group.domain} was given parameters of another domain")
        self.policy, self.domain_group, self.buffer_pool = policy, domain_group, buffer_pool
        # False: parameters nothing trains, sharded and gathered like the others but with no gradient,
        # master or optimizer state, and in no reducer or optimizer ([Note: frozen parameters at stage 3]).
        self.trainable = trainable
        self.group, self.rank, self.world_size = domain_group.group, domain_group.rank, domain_group.size
        self.layout: FlatLayout = plan_layout([p.numel() for p in params], bucket_numel=bucket_numel,
                                              world_size=self.world_size)
        self.views = FlatViews(self.layout, self.rank, sharded_steps=policy.shard_optimizer_state)
        placeholders: Sequence[torch.Tensor | None] = [None] * len(params)
        nans = None
        if policy.shard_parameters:
            # Sharded parameters: their data while sharded, made once ([Note: sharded placeholder] in param_storage.py).
            nans, placeholders = sharded_access.placeholders([tuple(p.shape) for p in params], param_dtype,
                                                             params[0].device)
        self.records = make_records(params, names, placements, self.layout.slots, domain_group, placeholders)
        self.storage, master = self._build_storage(param_dtype, nans, keep_master and trainable)
        self.device, self.param_dtype = self.storage.device, param_dtype
        self.grads = GradStorage(self.records, self.views, policy=policy, domain_group=domain_group,
                                 use_reduce_scatter=use_reduce_scatter, dtype=param_dtype, device=self.device,
                                 buffer_pool=buffer_pool, trainable=trainable)
        self.optimizer = OptimizerView(self.views, self.storage, master)
        # Fixed for the group's life: the same objects as the parts' (the hot paths read them directly).
        self.plan, self.buckets = self.grads.plan, self.grads.buckets
        self.grad_buffer, self.grad_shard = self.grads.grad_buffer, self.grads.grad_shard
        self.optimizer_tensors, self.master = self.optimizer.tensors, master

    def _build_storage(self, param_dtype: torch.dtype, nans: torch.Tensor | None,
                       keep_master: bool) -> tuple[ParamStorage, torch.Tensor | None]:
        """The parameter storage from the agreed initial values, and the fp32 master (mixed precision,
        where something steps: `keep_master`)."""
        views = self.views
        # Sharded parameters: only this rank's shard is built when the ranks already agree (no full buffer).
        owned = initial_shard(self.records, self.layout, self.rank, self.group) if nans is not None else None
        initial = gather_initial_values(self.records, self.layout, self.group) if owned is None else owned

        def stepped() -> torch.Tensor:  # what this rank steps, as one tensor (a copy)
            if owned is not None:
                return owned
            return torch.cat([views.stepped(i, initial) for i in range(views.num_buckets)])

        # Mixed precision: the fp32 master starts from the fp32 values, not from their casts.
        master = stepped() if param_dtype != initial.dtype and keep_master else None
        if nans is not None:
            return ShardedParams(self.records, views, shard=stepped().to(param_dtype), nans=nans, group=self.group,
                                 buffer_pool=self.buffer_pool, secondary=self.domain_group.secondary,
                                 weight_bits=self.domain_group.weight_bits), master
        return FullParams(self.records, views, buffer=initial.to(param_dtype), gathers=self.gathers_params,
                          group=self.group), master

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters, in layout order."""
        return [r.param for r in self.records]

    @property
    def domain(self) -> Domain:
        return self.domain_group.domain

    # ------------------------------------------------------------------ the parameter storage
    @property
    def state(self) -> ParamState:
        return self.storage.state

    @property
    def param_buffer(self) -> torch.Tensor | None:
        return self.storage.param_buffer

    @property
    def param_shard(self) -> torch.Tensor | None:
        return self.storage.param_shard

    @property
    def registration(self) -> sharded_access.Registration | None:
        return self.storage.registration

    @property
    def shard_offloaded(self) -> bool:
        return self.storage.shard_offloaded

    @property
    def is_unsharded(self) -> bool:
        """Whether the parameters' full values are in the full buffer with no gather left to wait for."""
        return self.storage.is_unsharded

    def start_unshard(self) -> None:
        """Issue the all-gathers that make the full buffer current (async, one per bucket)."""
        self.storage.start_unshard()

    def prepare_unshard(self) -> None:
        """An offloaded shard: read it into its place in the full buffer the next gather fills in place."""
        self._sharded().prepare_unshard()

    def drop_prepared_unshard(self) -> None:
        """Give back what `prepare_unshard()` read, the gather not issued (a read failed elsewhere)."""
        self._sharded().drop_prepared_unshard()

    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight. Sharded parameters stay placeholders until
        `finish_unshard()` ([Note: early gather] in runtime.py); full ones are current after this."""
        self.storage.wait_unshard()

    def finish_unshard(self) -> None:
        """Wait, then (sharded parameters) point the parameters at the full buffer."""
        self.storage.finish_unshard()

    def unshard(self) -> None:
        """`start_unshard()` and `finish_unshard()`."""
        self.start_unshard()
        self.finish_unshard()

    def reshard(self) -> None:
        """Free the full buffer (sharded parameters: [Note: sharded placeholder] in param_storage.py)."""
        self.storage.reshard()

    def release_pooled_buffers(self) -> None:
        """Free the pool's buffers not in use (the engine is destroyed); the pool is shared by the groups."""
        if self.buffer_pool is not None:
            self.buffer_pool.clear()

    def enable_access_check(self) -> None:
        """Register this group's placeholders with the access check whenever it is sharded,
        until the group is garbage collected."""
        self._sharded().enable_access_check()

    def _sharded(self) -> ShardedParams:
        assert isinstance(self.storage, ShardedParams), f"{self.records[0].name}...: the parameters are not sharded"
        return self.storage

    # ------------------------------------------------------------------ the post-step gather of full parameters
    @property
    def gathers_params(self) -> bool:
        """Sharded optimizer state, full parameters (stages 1/2, stage 3's persistent groups): each
        rank steps its shards, which an all-gather then brings to every rank."""
        return self.policy.shard_optimizer_state and not self.policy.shard_parameters

    @property
    def gather_slot(self) -> GatherSlot | None:
        return self.storage.gather_slot

    @property
    def gather_blocked_s(self) -> float:
        """Time this rank spent blocked waiting for the post-step gathers, all steps."""
        return self.storage.gather_blocked_s

    @property
    def pending_gather(self) -> PendingGather | None:
        return None if self.gather_slot is None else self.gather_slot.pending

    @property
    def is_gathering_params(self) -> bool:
        """Whether the last step's gather is still to be waited for (by the group or the access check)."""
        pending = self.pending_gather
        return pending is not None and not pending.done

    def finish_gather_params(self) -> None:
        """Wait for the in-place gather `start_unshard()` issued (full parameters), if any."""
        if isinstance(self.storage, FullParams):
            self.storage.wait_unshard()

    # ------------------------------------------------------------------ gradients
    def reduced_grad(self, index: int) -> torch.Tensor:
        """Bucket `index`'s reduced gradient, matching `optimizer_tensors[index]`."""
        return self.grads.reduced_grad(index)

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard of every bucket's reduced gradient: disjoint across ranks."""
        return self.grads.owned_grads()

    def norm_grads(self) -> list[torch.Tensor]:
        """What this rank adds to the global gradient norm ([Note: copies counted elsewhere] in comm/domains.py)."""
        return self.grads.norm_grads()

    def add_grad(self, index: int, grad: torch.Tensor) -> Bucket:
        """Add parameter `index`'s gradient to its bucket (the window's first one overwrites); returns that bucket."""
        return self.grads.add_grad(index, grad)

    def holds_gradients(self) -> bool:
        """Whether any gradient was written or reduced since the last optimizer step."""
        return self.grads.holds_gradients()

    # ------------------------------------------------------------------ the optimizer's view
    def owned_part(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of bucket `index` within an optimizer-space tensor (OptimizerView.owned_part)."""
        return self.optimizer.owned_part(index, tensor)

    def copy_master_to_params(self) -> None:
        self.storage.drop_secondary()  # the shards take new values (a step, a checkpoint): hpZ's copy is stale
        self.optimizer.copy_master_to_params()

    def take_shard_from_full(self) -> None:
        """After the full parameters were changed in place (GatheredParameters with a modifier
        rank): take this rank's shard and master weights from them again."""
        self.storage.take_shard_from_full()
        self.optimizer.take_from_params()

    @torch.no_grad()
    def load_full_values(self, values: Sequence[torch.Tensor]) -> None:
        """Sharded parameters, not gathered: take this rank's shard of the whole values `values`
        (one per parameter, in `params` order; every rank of the domain passes the same). No
        collective: a frozen group's load from a checkpoint ([Note: frozen parameters at stage 3])."""
        storage = self._sharded()
        assert storage.state is ParamState.SHARDED and storage.param_shard is not None, \
            f"{self.records[0].name}...: load_full_values while {storage.state.value}"
        full = torch.zeros(self.layout.total_numel, dtype=self.param_dtype, device=self.device)
        for slot, value in zip(self.layout.slots, values):
            full[slot.offset: slot.offset + slot.numel].copy_(value.reshape(-1))
        storage.drop_secondary()
        for index in range(self.views.num_buckets):
            self.views.shard(index, storage.param_shard).copy_(self.views.bucket(index, full, owned=True))

    @property
    def stepped_store(self) -> SteppedStore | None:
        """Where the optimizer tensors' values live when not in memory ([Note: stepped values elsewhere])."""
        return self.optimizer.store

    def stepped_values(self, index: int) -> torch.Tensor:
        """`optimizer_tensors[index]`'s values: the tensor itself, or a copy read from where they live."""
        return self.optimizer.values(index)

    def write_stepped(self, index: int, values: torch.Tensor) -> None:
        """Set `optimizer_tensors[index]`'s values (a load)."""
        self.optimizer.write(index, values)

    def cast_stepped(self, index: int, start: int, values: torch.Tensor) -> None:
        """Mixed precision: new master values of bucket `index` from element `start`, cast into the parameters."""
        self.optimizer.cast(index, start, values)

    def release_stepped(self, store: SteppedStore, shard: bool) -> None:
        """The store holds the stepped values now: the master (and, `shard`, the parameter shard) leave
        memory; each becomes a NaN broadcast to its shape (no memory; never a stale value)."""
        self.optimizer.release(store)
        if shard and isinstance(self.storage, ShardedParams):
            self.storage.offload_shard(self.optimizer.read_into)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state held by this group on this rank, by kind."""
        return {"params": self.storage.params_bytes(), "grads": self.grads.grads_bytes(),
                "master": self.optimizer.master_bytes()}
