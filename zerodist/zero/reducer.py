"""Gradient hooks and the order in which buckets are synchronised.

Every rank must issue its bucket collectives in the same order, or they pair up wrongly and
hang (or silently mix data). Autograd's order can differ between ranks when control flow does
(a parameter unused on one rank), so buckets are started in one fixed order derived from the
model's structure, never in the order they happen to fill: bucket k starts only once buckets
0..k-1 have started. The order sorts buckets by the position of their earliest parameter,
latest first, which is about the order backward fills them.

A bucket that is not complete when backward ends (unused parameters) is started then; its
missing gradients are zeros.

While `deferring` (a caller drives the unit runtime: [Note: driving the runtime] in runtime.py)
no bucket is reduced in backward: each keeps its full-size gradient across backwards, as stages
0/1 always do, and `reduce_deferred()` reduces them all once, in the same fixed order. A caller
that knows some buckets' gradients are complete earlier (a pipeline stage's REDUCE_GRAD:
zerodist/engine/pipeline.py) reduces those with `reduce_deferred_buckets(...)`, in the fixed order
among themselves; `reduce_deferred()` then reduces only the rest. Each bucket's collective is the
same whenever it runs, so the result is bitwise the one reduction's.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable

import torch

from zerodist.zero.bucket import Bucket
from zerodist.zero.flat_group import FlatParamGroup


class GradReducer:
    """Owns the gradient hooks of all groups and starts/finishes their buckets in order."""

    def __init__(self, groups: list[FlatParamGroup], positions: list[list[int]], *, max_in_flight: int | None,
                 overlap: bool = True, on_complete: Callable[[Bucket], None] | None = None):
        self.groups = groups
        keyed = []
        for group, group_positions in zip(groups, positions):
            for bucket in group.buckets:
                earliest = min(group_positions[i] for i in bucket.span.param_indices)
                keyed.append((earliest, bucket))
        self.order: list[Bucket] = [b for _, b in sorted(keyed, key=lambda kb: -kb[0])]
        self.max_in_flight = max_in_flight
        # overlap_comm: start each bucket's collective as soon as it (and every earlier one) is full,
        # while backward goes on; off: start them all when backward ends (same collectives, same order).
        self.overlap = overlap
        # Debug observers (zerodist.debug: NaN hunt, gradient sync check): fn(group, index, grad) sees each
        # parameter's local gradient before it is added to its bucket. Empty: no cost.
        self.grad_observers: list[Callable[[FlatParamGroup, int, torch.Tensor], None]] = []
        # Stage 3 listens, to reshard complete units.
        self.on_complete = on_complete
        self.sync_enabled = True
        self.deferring = False  # a caller reduces, once, with reduce_deferred()
        self._deferred = False  # a backward ran while deferring and its gradients are not reduced yet
        self.grads_seen = 0
        self._early: set[int] = set()  # ids of buckets reduce_deferred_buckets reduced in this accumulation
        self._next = 0
        self._in_flight: collections.deque[Bucket] = collections.deque()
        # The hooks hold the reducer weakly: torch does not let the garbage collector see through a
        # tensor's post-accumulate-grad hooks, so a strong reference back to the groups (which hold
        # the parameters) would be a cycle never freed, keeping every dropped engine alive.
        me = weakref.ref(self)
        self._handles = [
            param.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, position, index))
            for position, group in enumerate(groups)
            for index, param in enumerate(group.params)
        ]

    def _on_grad_ready(self, group: FlatParamGroup, index: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        for observe in self.grad_observers:
            observe(group, index, param.grad)
        bucket = group.add_grad(index, param.grad)
        param.grad = None  # the gradient now lives in the bucket; free autograd's copy
        self.grads_seen += 1
        if bucket.register_grad_ready():
            if self.sync_enabled and self.overlap and not self.deferring:
                self._start_complete_buckets()
            if self.on_complete is not None:
                self.on_complete(bucket)

    def _start_complete_buckets(self, force: bool = False) -> None:
        while self._next < len(self.order) and (force or self.order[self._next].is_complete):
            bucket = self.order[self._next]
            if id(bucket) in self._early:  # reduced already (reduce_deferred_buckets)
                self._next += 1
                continue
            bucket.start_grad_sync()
            self._in_flight.append(bucket)
            self._next += 1
            if self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
                self._in_flight.popleft().finish_grad_sync()

    def end_backward(self) -> None:
        """After autograd returns: sync what is left (if syncing), then ready for the next backward."""
        if self.deferring:
            self._deferred = True
            for bucket in self.order:
                bucket.reset(keep_gradient=True)
            return
        self._reduce_all(self.sync_enabled)

    def _reduce_all(self, sync: bool) -> None:
        if sync:
            self._start_complete_buckets(force=True)
            while self._in_flight:
                self._in_flight.popleft().finish_grad_sync()
        for bucket in self.order:
            if not sync:
                bucket.end_micro_step()  # a no-op but in the layout-invariant mode (zero/canonical.py)
            bucket.reset()
        self._next = 0
        if sync:
            self._early.clear()

    def reduce_accumulated(self) -> None:
        """Stages 0/1, between backwards: reduce what the micro-steps since the last reduction
        accumulated locally (backwards that did not sync), now, once; collective, every rank alike."""
        assert not self.deferring and not self._in_flight, "reduce_accumulated: between backwards, not deferring"
        self._reduce_all(sync=True)
        self.sync_enabled = True  # the gradients are reduced now, as after a syncing backward (the next sets it again)

    def reduce_deferred(self) -> None:
        """Reduce every bucket's gradient accumulated while deferring (collective), once."""
        if self._deferred:
            self._deferred = False
            self._reduce_all(sync=True)

    def reduce_deferred_buckets(self, buckets: list[Bucket]) -> None:
        """While deferring: reduce `buckets` now (collective over each one's group; every rank of
        that group must call it alike), in the fixed order, the others staying deferred. The caller
        promises no later backward of this accumulation writes to them; `reduce_deferred()` skips them."""
        assert self.deferring and not self._in_flight, "reduce_deferred_buckets: only while deferring, between backwards"
        wanted = {id(b) for b in buckets}
        chosen = [b for b in self.order if id(b) in wanted and id(b) not in self._early]
        for bucket in chosen:
            bucket.start_grad_sync()
            self._in_flight.append(bucket)
            if self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
                self._in_flight.popleft().finish_grad_sync()
        while self._in_flight:
            self._in_flight.popleft().finish_grad_sync()
        for bucket in chosen:
            bucket.reset()
            self._early.add(id(bucket))

    def settle_gradients(self) -> None:
        """Before the optimizer reads the buckets: zero what no gradient was written to (already done
        by each bucket's collective; needed when the boundary micro-step ran under `no_sync`)."""
        for bucket in self.order:
            bucket.settle()

    def clear_gradients(self) -> None:
        self._early.clear()
        for bucket in self.order:
            bucket.clear_gradients()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _grad_ready(reducer_ref: weakref.ref[GradReducer], position: int, index: int, param: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._on_grad_ready(reducer.groups[position], index, param)
