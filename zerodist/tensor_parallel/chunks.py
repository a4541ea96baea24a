"""Domino's chunks taking turns through a block's own forward (any model, no knowledge of its code).

Domino splits a block's batch into k chunks so that the row-parallel all-reduce of one chunk runs
while the next chunk computes. With the block's residual branches written out (`domino.py`,
the demo GPT) the schedule is a loop over branches; for a block we know nothing about (a Hugging
Face decoder layer, a model made from DeepSpeed's `layer_specs`), the chunks run the block's own
`forward` *in turns*: each chunk runs in its own thread, one at a time (a baton passed
explicitly, never two running at once), and yields the baton where a row-parallel layer has
issued its reduction. So

    chunk 0: ... o_proj partial, issue all-reduce | yield
    chunk 1: ... o_proj partial, issue all-reduce | yield
    chunk 0: wait (chunk 1 computed meanwhile), add, norm, MLP ..., issue | yield
    ...

which is Domino's schedule, found at run time: the row-parallel layers (`layers.row_reduce`) ask
`chunk_turn()` whether they run inside a chunk. Turns go round in chunk order, so every rank
issues the same collectives in the same order. Between blocks (`overlap="inter"`) a chunk may stay
parked at its last reduction of block n while the others start block n+1; the next block's work is
queued behind it, so that reduction is waited under the next block's first chunk.

The threads are an implementation detail of one forward: grad mode, autocast and the saved-tensor
hooks of the block's call are carried into them, they are ended when the forward ends (or raises),
and they never run concurrently.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerodist import compat
from zerodist.comm import CommHandle
from zerodist.tensor_parallel import schedule
from zerodist.tensor_parallel.operators import TensorRegion, all_reduce_

_current = threading.local()


def chunk_turn() -> Chunk | None:
    """The Domino chunk this thread runs, or None outside Domino's generic schedule."""
    return getattr(_current, "chunk", None)


# ------------------------------------------------------------------ asynchronous reductions
class PendingReduction:
    __slots__ = ("handle", "collective")

    def __init__(self) -> None:
        self.handle: CommHandle | None = None
        self.collective = -1


class IssueReduction(torch.autograd.Function):
    """Forward: start the all-reduce of `partial` in place (the caller made it and reads it
    nowhere else); backward: identity (g's adjoint)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, region: TensorRegion, pending: PendingReduction):
        out = partial if partial.is_contiguous() else partial.contiguous()
        pending.collective = schedule.log_issue("forward", out.numel() * out.element_size())
        pending.handle = all_reduce_(out, region, async_op=True)
        if out is partial:
            ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class WaitReduction(torch.autograd.Function):
    """Forward: wait for the reduction started by `IssueReduction`; backward: identity."""

    @staticmethod
    def forward(ctx, reduced: torch.Tensor, pending: PendingReduction):
        schedule.wait(pending.handle, pending.collective, "forward")
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# ------------------------------------------------------------------ chunks in turns
class _Abort(BaseException):
    """Raised inside a parked chunk to unwind it when the forward is abandoned."""


class Chunk:
    """One chunk's thread: runs its queued items (one block call each) in order, yielding the
    baton at every reduction it issues."""

    def __init__(self, runner: ChunkRunner, index: int, value: Any):
        self.runner, self.index, self.value = runner, index, value
        self.queue: collections.deque[Callable[[Any], Any]] = collections.deque()
        self.running = False  # inside an item (so parked at a reduction when it is not its turn)
        self.issues = 0       # reductions issued in the current item
        self.done = 0         # items finished (block calls this chunk has left)
        self.parked_at: torch.Tensor | None = None  # the reduction it waits for while parked
        self.error: BaseException | None = None
        self.abort, self.alive = False, True
        self._turn = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._main, name=f"zerodist-domino-chunk-{index}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        _current.chunk = self
        self._turn.acquire()
        while not self.abort:
            if self.queue and self.error is None:
                item = self.queue.popleft()
                self.running, self.issues = True, 0
                try:
                    self.value = item(self.value)
                    self.done += 1
                    self.runner.record_done(self)
                except _Abort:
                    self.running = False
                    break
                except BaseException as error:  # handed to the main thread, raised there
                    self.error = error
                self.running = False
                if self.queue and self.error is None:
                    continue  # straight into the next block: its first chunk runs under our pending reduction
            self.runner.baton.release()
            self._turn.acquire()
        self.alive = False
        self.runner.baton.release()

    def park(self) -> None:
        """Give the baton back and wait for this chunk's next turn (in the chunk's thread)."""
        self.runner.baton.release()
        self._turn.acquire()
        if self.abort:
            raise _Abort()

    def reduce(self, partial: torch.Tensor, region: TensorRegion) -> torch.Tensor:
        """A row-parallel layer's partial product, all-reduced while the other chunks take their
        turns (in the chunk's thread)."""
        pending = PendingReduction()
        schedule.log_compute("forward", "body")
        out = IssueReduction.apply(partial, region, pending)
        self.issues += 1
        self.parked_at = out  # what a block hands on while this chunk waits here (a pytree leaf: domino.py)
        try:
            self.park()
        finally:
            self.parked_at = None
        return WaitReduction.apply(out, pending)

    def step(self) -> None:
        """Run this chunk until it parks or runs out of work (in the main thread)."""
        self._turn.release()
        self.runner.baton.acquire()

    def join_thread(self) -> None:
        self._thread.join()


SavedTensorHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def saved_tensor_hooks_now() -> SavedTensorHooks | None:
    """[Note: hooks into chunks] This thread's innermost saved-tensor hooks, (pack, unpack), or None.
    torch keeps the hook stack per thread, so hooks entered around a block's call in the main thread
    (ZeRO-3's `SavedParameterViews`, entered by the unit's forward pre-hook; a user's `save_on_cpu`)
    never see what a chunk's thread saves: captured here, at the block's call, and re-entered by
    each chunk around its item (`ChunkRunner.thread_state`). Only the innermost pair packs in torch,
    and ZeRO's composes with the ones outside it, so that pair is the whole stack's behaviour."""
    if not torch.is_grad_enabled() or not compat.saved_tensors_hooks_enabled():
        return None
    try:
        return compat.outer_saved_tensors_hooks()
    except compat.UnsupportedTorchError:  # no way to read them: saved as usual (memory, not values)
        return None


_MISSING: Any = object()


@dataclasses.dataclass
class _Watch:
    """A callback waiting for every chunk to finish one item (`ChunkRunner.when_done`)."""

    item: int
    callback: Callable[[list[Any]], None]
    values: list[Any]


class ChunkRunner:
    """The chunks of one forward and the baton they pass (see the module docstring)."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.baton = threading.Semaphore(0)
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in ("cpu", "cuda") if device == "cpu" or torch.cuda.is_available()}
        self.chunks = [Chunk(self, index, value) for index, value in enumerate(inputs)]
        self.closed = False
        self.items = 0  # block calls submitted
        self._watches: list[_Watch] = []  # [Note: unfinished outputs] in zerodist/utils/unfinished.py

    @contextlib.contextmanager
    def thread_state(self, hooks: SavedTensorHooks | None = None) -> Iterator[None]:
        """The main thread's grad mode and autocast, in a chunk's thread, and `hooks` (the
        saved-tensor hooks of the block's call: [Note: hooks into chunks])."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, (enabled, dtype) in self.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
            if hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
            yield

    def submit(self, items: list[Callable[[Any], Any]]) -> None:
        """Queue one item per chunk: it receives the chunk's value and returns its next one."""
        for chunk, item in zip(self.chunks, items):
            chunk.queue.append(item)
        self.items += 1

    def when_done(self, item: int, callback: Callable[[list[Any]], None]) -> None:
        """Call `callback(values)` (each chunk's value when it finished item `item`, the block call
        of that number) once every chunk has finished it: at once if they have, else in the main
        thread, in `run`, after the turn in which the last one did. Dropped if the runner closes first."""
        if any(chunk.done > item + 1 for chunk in self.chunks):
            raise AssertionError("when_done on an item a chunk has left behind it")  # its value is gone
        self._watches.append(_Watch(item, callback, [chunk.value if chunk.done > item else _MISSING
                                                     for chunk in self.chunks]))
        self._fire()

    def record_done(self, chunk: Chunk) -> None:
        """`chunk` finished an item (in the chunk's thread, holding the baton): keep its value for a
        watch on that item; the callbacks run in the main thread (`_fire`)."""
        for watch in self._watches:
            if watch.item == chunk.done - 1:
                watch.values[chunk.index] = chunk.value

    def _fire(self) -> None:
        for watch in [w for w in self._watches if all(v is not _MISSING for v in w.values)]:
            self._watches.remove(watch)
            watch.callback(watch.values)

    def run(self, stay_parked: Callable[[Chunk], bool] | None = None) -> None:
        """Turns in chunk order until every chunk has run its queued items, or is parked where
        `stay_parked(chunk)` says it may wait for the next block. Closes the runner on error."""
        try:
            while True:
                progressed = False
                for chunk in self.chunks:
                    if not chunk.running and not chunk.queue:
                        continue
                    if chunk.running and stay_parked is not None and stay_parked(chunk):
                        continue
                    chunk.step()
                    progressed = True
                    if chunk.error is not None:
                        error, chunk.error = chunk.error, None
                        raise error
                    if self._watches:
                        self._fire()
                if not progressed:
                    return
        except BaseException:
            self.close()
            raise

    def values(self) -> list[Any]:
        return [chunk.value for chunk in self.chunks]

    def close(self) -> None:
        """End every chunk's thread (unwinding a parked one). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._watches = []  # a block its chunks never finished: nobody is called back
        for chunk in self.chunks:
            if chunk.alive:
                chunk.abort = True
                chunk.step()
            chunk.join_thread()
