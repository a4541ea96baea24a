"""A gradient bucket and its lifecycle.

    FILLING --register_grad_ready() x num_params--> (complete)
            --start_grad_sync()--> SYNCING --finish_grad_sync()--> SYNCED --reset()--> FILLING

What a sync moves depends on the stage, set once in `GradSyncPlan`:
- stages 0 and 1 accumulate every micro-step's gradient into a persistent full-size bucket
  view and reduce it at the accumulation boundary (stage 0 always all-reduces, as DDP does,
  so every rank holds the full averaged gradient);
- stage 2 copies each micro-step's gradient into a transient staging buffer, reduces it
  straight into this rank's shard and frees the staging buffer (stage 3: gives it back to the
  engine's buffer pool, [Note: buffer pool] in buffer_pool.py).
At stages 1-3 the collective is the one configured: reduce-scatter (`reduce_scatter: true`)
or all-reduce.
The sum is divided after reduction, in the same way in every stage ([Note: alignment] in
layout.py says why that matters), by the number of batch shards: the group's size for a dense
parameter, more than it for one whose domain is a strict subgroup ([Note: sharding domains] in
zerodist/comm/topology.py).

[Note: no gradient memset] No gradient buffer is zero-filled per step. A buffer's contents are
stale at the start of its accumulation window (stages 0/1: the persistent buffer after each
optimizer step; stages 2/3: a staging buffer fresh from `torch.empty`, or from stage 3's buffer
pool, each micro-step), and
`Bucket` keeps the set of its parameters not yet written in that window: a parameter's first
gradient is copied over the stale slice, later ones are added to it. Before anything reads the
buffer (the bucket's collective, or the optimizer step when no collective ran: `no_sync` on the
boundary micro-step), `zero_unwritten()` zeroes what is still unwritten, the slices of
parameters that got no gradient (unused in this window, so their gradient is exactly zero) and
the bucket's padding, and nothing else. The result is bitwise the sum that zeros-then-add gave
(except that a first gradient of -0.0 stays -0.0, as autograd's own `.grad` keeps it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.comm import collectives
from zerodist.zero import canonical
from zerodist.zero.buffer_pool import BufferPool
from zerodist.comm.quantized import quantized_reduce_scatter_start
from zerodist.zero.layout import BucketSpan, ParamSlot
from zerodist.zero.policy import QuantizedReduction


class BucketState(enum.Enum):
    FILLING = "filling"
    SYNCING = "syncing"
    SYNCED = "synced"


@dataclasses.dataclass(frozen=True)
class GradSyncPlan:
    use_reduce_scatter: bool
    persistent_full_grad: bool  # full gradients (stages 0/1): a full-size buffer lives across micro-steps
    divisor: int  # the reduced sum is divided by this: the number of batch shards
    # Hierarchical sharding (zerodist/zero/hierarchy.py): the reduced shard is then all-reduced over these ranks.
    replica_group: Group = None
    comm_dtype: torch.dtype | None = None  # communication_data_type: reduce in this type, cast back after
    quantized: QuantizedReduction | None = None  # qgZ: a quantized all-to-all replaces the reduce-scatter


class Bucket:
    """One bucket of one `FlatParamGroup`: its gradient views, its pending collective."""

    span: BucketSpan
    num_params: int
    num_ready: int
    state: BucketState
    grad_full: torch.Tensor | None  # persistent full view (stages 0/1)
    grad_owned: torch.Tensor  # where this rank's reduced shard ends up
    staging: torch.Tensor | None  # stage 2's transient full-size buffer
    accumulated: bool  # stage 2: grad_owned already holds an earlier micro-step
    unwritten: set[int]  # parameters (group indices) with no gradient in the window: [Note: no gradient memset]
    settled: bool  # zero_unwritten() ran since the window began: the full buffer is the gradient

    def __init__(self, span: BucketSpan, *, plan: GradSyncPlan, grad_full: torch.Tensor | None,
                 grad_owned: torch.Tensor, group: Group, rank: int, label: str, slots: Sequence[ParamSlot],
                 buffer_pool: BufferPool | None = None):
        self.span, self.plan, self.group, self.rank, self.label = span, plan, group, rank, label
        self.buffer_pool = buffer_pool  # stage 3: where staging buffers come from and go back to
        self.num_params = len(span.param_indices)
        # Each parameter's [start, end) within the bucket, by its index in the group.
        self._ranges = {s.index: (s.offset - span.offset, s.offset - span.offset + s.numel) for s in slots}
        assert sorted(self._ranges) == sorted(span.param_indices), f"{label}: slots do not match the bucket"
        self.grad_full, self.grad_owned = grad_full, grad_owned
        self.staging = None
        self.accumulated = False
        # The layout-invariant mode sets a counter here (zero/apply.py): [Note: the canonical tree] in canonical.py
        self.tree: canonical.CanonicalSum | None = None
        self.paired = False  # stages 0/1 in the mode: the full buffer holds g_2i, the next micro-step adds g_2i+1
        self._pending: tuple[comm.CommHandle | canonical.OrderedReduction, torch.Tensor, torch.Tensor] | None = None
        self._begin_window()
        self.reset()

    def _begin_window(self) -> None:
        """The full-size buffer's contents become stale: every parameter's first gradient overwrites."""
        self.unwritten = set(self.span.param_indices)
        self.settled = False

    def grad_target(self) -> torch.Tensor:
        """The full-size buffer that backward's gradients are written into (stale until written:
        [Note: no gradient memset])."""
        if self.plan.persistent_full_grad:
            assert self.grad_full is not None
            return self.grad_full
        if self.staging is None:
            dtype, device = self.grad_owned.dtype, self.grad_owned.device
            self.staging = (self.buffer_pool.take(self.span.numel, dtype, device) if self.buffer_pool is not None
                            else torch.empty(self.span.numel, dtype=dtype, device=device))
            self._begin_window()
        return self.staging

    def _drop_staging(self) -> None:
        """The staging buffer's contents are no longer needed: back to the pool (or freed)."""
        staging, self.staging = self.staging, None
        if staging is not None and self.buffer_pool is not None:
            self.buffer_pool.give(staging)

    def write_grad(self, index: int, grad: torch.Tensor) -> None:
        """Parameter `index`'s gradient into its slice: copied over a stale slice, added to a written one."""
        start, end = self._ranges[index]
        target = self.grad_target()[start:end]
        if index in self.unwritten:
            target.copy_(grad.reshape(-1))
            self.unwritten.discard(index)
        else:
            target.add_(grad.reshape(-1))

    def zero_unwritten(self) -> None:
        """Zero what no gradient was written to in this window (parameters without a gradient, and
        the padding), so the full buffer holds exactly the gradient; a no-op once done."""
        if self.settled or (self.staging is None and not self.plan.persistent_full_grad):
            return  # done, or no staging buffer this micro-step (stages 2/3 outside backward)
        target = self.grad_target()
        runs: list[list[int]] = []  # merged [start, end) ranges: one zero_() per contiguous run
        for start, end in sorted(self._ranges[i] for i in self.unwritten):
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        used = max(end for _, end in self._ranges.values())
        if used < self.span.numel:  # the padding after the last parameter
            if runs and runs[-1][1] == used:
                runs[-1][1] = self.span.numel
            else:
                runs.append([used, self.span.numel])
        for start, end in runs:
            target[start:end].zero_()
        self.unwritten.clear()
        self.settled = True

    @property
    def is_complete(self) -> bool:
        return self.num_ready == self.num_params

    def register_grad_ready(self) -> bool:
        """Count one parameter's gradient in; True when the bucket is complete."""
        assert self.state is BucketState.FILLING, f"{self.label}: gradient arrived while {self.state.value}"
        assert self.num_ready < self.num_params, (
            f"{self.label}: {self.num_ready + 1} gradients for {self.num_params} parameters in one backward"
        )
        self.num_ready += 1
        return self.is_complete

    def start_grad_sync(self) -> None:
        """Issue the configured collective (async) over the full bucket."""
        assert self.state is BucketState.FILLING, f"{self.label}: start_grad_sync while {self.state.value}"
        target = self.grad_target()
        self.zero_unwritten()
        cast = self.plan.comm_dtype is not None and self.plan.comm_dtype != target.dtype
        source = target.to(self.plan.comm_dtype) if cast else target  # communication_data_type
        if self.tree is not None and self.plan.persistent_full_grad:  # (no cast: canonical.check_layout)
            self.tree.fold_into(source)  # stages 0/1: this micro-step's leaf and the earlier ones' partial sums
        lo = self.rank * self.span.shard_numel
        handle: comm.CommHandle | canonical.OrderedReduction
        if self.plan.use_reduce_scatter:
            direct = (self.plan.persistent_full_grad or not self.accumulated) and not cast
            out = self.grad_owned if direct else self.grad_owned.new_empty(self.grad_owned.shape, dtype=source.dtype)
            # the full buffer is scratch once reduced: stages 2/3 free it, stages 0/1 read only grad_owned
            if self.tree is not None:  # the layout-invariant mode: pieces added in rank order
                handle = canonical.reduce_scatter(out, source, self.group)
            elif self.plan.quantized is not None:  # qgZ: summed in fp32, cast into `out`
                q = self.plan.quantized
                handle = quantized_reduce_scatter_start(source, q.group, q.bits, inter_group=q.inter_group, out=out)
            else:
                handle = collectives.reduce_scatter(out, source, group=self.group, async_op=True,
                                                    input_is_scratch=True)
        else:
            handle = (canonical.all_reduce(source, self.group) if self.tree is not None else
                      comm.all_reduce(source, group=self.group, async_op=True))
            out = source[lo: lo + self.span.shard_numel]
        self._pending = (handle, out, source)
        self.state = BucketState.SYNCING

    def finish_grad_sync(self) -> None:
        """Wait, average, and land the result in `grad_owned` (and the full view for stage 0)."""
        assert self.state is BucketState.SYNCING and self._pending is not None, (
            f"{self.label}: finish_grad_sync while {self.state.value}"
        )
        handle, out, source = self._pending
        handle.wait()
        self._pending = None
        del handle  # its work may hold the staging buffer, which goes back to the pool below
        if self.plan.replica_group is not None:  # hierarchical sharding: sum the shard over the replicas
            comm.all_reduce(out, group=self.plan.replica_group)
        if self.plan.use_reduce_scatter:
            out.div_(self.plan.divisor)
        else:
            source.div_(self.plan.divisor)
        if self.plan.persistent_full_grad:
            if source is not self.grad_full:  # reduced in communication_data_type: back into the buffer
                if self.plan.use_reduce_scatter:
                    self.grad_owned.copy_(out)
                else:
                    self.grad_target().copy_(source)
        else:
            if self.tree is not None:
                self.tree.push(self._own_leaf(out))  # stages 2/3: the micro-steps' sums, by the canonical tree
            elif out is not self.grad_owned:
                if self.accumulated:
                    self.grad_owned.add_(out)
                else:
                    self.grad_owned.copy_(out)
            self.accumulated = True
            self._drop_staging()
        self.state = BucketState.SYNCED

    def _own_leaf(self, out: torch.Tensor) -> torch.Tensor:
        """The micro-step's reduced shard as a tensor the counter may keep: `grad_owned` first (where the
        sum ends), then the reduce-scatter's own output, or a copy of the all-reduced staging slice."""
        if not self.accumulated:
            if out is not self.grad_owned:
                self.grad_owned.copy_(out)
            return self.grad_owned
        return out if self.plan.use_reduce_scatter else out.clone()

    def reset(self, keep_gradient: bool = False) -> None:
        """Ready for the next backward (gradients already reduced stay where they are; with
        `keep_gradient`, so does the staging buffer's unreduced sum, which the next backward adds to)."""
        assert self._pending is None, f"{self.label}: reset with a collective still in flight"
        self.num_ready = 0
        self.state = BucketState.FILLING
        if not keep_gradient:
            self._drop_staging()

    def settle(self) -> None:
        """Before the optimizer reads the gradient: `zero_unwritten()`, and in the layout-invariant mode
        the counter's partial sums added up (left there when the boundary micro-step did not sync)."""
        self.zero_unwritten()
        if self.tree is not None and self.tree.count:
            if self.plan.persistent_full_grad:
                self.tree.fold_into(self.grad_target())
            else:
                self.tree.fold()  # lands in grad_owned, the first leaf

    def end_micro_step(self) -> None:
        """Stages 0/1 in the layout-invariant mode, after a micro-step that did not sync: after an even
        one (2i) the next adds into the buffer (g_2i + g_2i+1: the tree's first level, as the default
        accumulation adds, no copy); after an odd one the pair becomes a leaf of the counter one level up
        (a copy) and the next micro-step writes the buffer afresh. At most log2(A) - 1 copies are kept."""
        if self.tree is not None and self.plan.persistent_full_grad:
            self.zero_unwritten()  # the buffer holds exactly this window's sum; later writes add to it
            if not self.paired:  # g_2i: the next micro-step adds g_2i+1 in place, the tree's first level, no copy
                self.paired = True
                return
            self.paired = False
            self.tree.push_copy(self.grad_target())  # a pair: a leaf of the counter one level up
            self._begin_window()

    def clear_gradients(self) -> None:
        """After the optimizer step: the next accumulation starts from zero, without a memset
        ([Note: no gradient memset]): the first gradients overwrite, the first sync overwrites `grad_owned`."""
        if self.tree is not None:
            self.tree.clear()
        self.paired = False
        self.reset()
        self.accumulated = False
        self._begin_window()

    @property
    def holds_gradients(self) -> bool:
        """Whether this window wrote or reduced anything yet (False right after an optimizer step)."""
        return (self.settled or len(self.unwritten) < self.num_params or self.accumulated
                or (self.tree is not None and self.tree.count > 0))
