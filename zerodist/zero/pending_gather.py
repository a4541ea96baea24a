"""A flat group's post-step all-gather of full parameters while in flight (stages 1/2, stage 3's
persistent groups): [Note: overlapped parameter gather] in runtime.py, [Note: parameters being
gathered] in sharded_access.py."""

from __future__ import annotations

import time

import torch

import zerodist.comm as comm
from zerodist.zero import sharded_access


class GatherSlot:
    """Where a group keeps its pending gather: a holder of its own, so that the finalizer that waits
    for it when the group is collected holds this, not the group."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: PendingGather | None = None

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


class PendingGather:
    """A flat buffer's all-gathers in flight, registered with the access check until waited for. It
    holds the handles and the registration, never the group: should the group be dropped first, a
    reader still waits for the collective that writes the parameters' storage."""

    __slots__ = ("handles", "registration", "blocked_s", "done")

    def __init__(self, handles: list[comm.CommHandle], buffer: torch.Tensor):
        self.handles = handles
        self.registration = sharded_access.PendingWrite(buffer, self.wait, self.is_complete)
        self.blocked_s = 0.0  # time spent blocked in wait(), for reports
        self.done = False

    def is_complete(self) -> bool:
        return all(handle.is_completed() for handle in self.handles)

    def wait(self) -> None:
        """Block until every all-gather is done; safe to call twice."""
        self.registration.clear()  # first: a torch call in what follows must not wait for this again
        started = time.perf_counter()
        for handle in self.handles:
            handle.wait()
        self.blocked_s += time.perf_counter() - started
        self.handles = []
        self.done = True
