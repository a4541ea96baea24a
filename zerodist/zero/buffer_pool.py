"""Stage 3's transient flat buffers, kept and handed out again instead of freed and allocated each step.

[Note: buffer pool] Every stage-3 step allocates a unit-sized buffer per gather (the full
parameters, from the all-gather to the reshard) and a bucket-sized staging buffer per gradient
bucket (from its first gradient to the end of its reduce-scatter): at 25.5M parameters that is
about 200 MiB allocated and freed per step in pieces of 12 MiB. On CPU, glibc's malloc serves such
requests from its heap once a freed block of that size has raised its mmap threshold, and the
heap keeps what is freed in its free lists, split and interleaved with the activations: rank 0's
resident memory there grew from step to step (853, 912, 966 ... 994 MiB over ten steps) while the
heap in use did not, with unit-sized holes between live blocks (a GPU's caching allocator keeps
such blocks for reuse; a CPU process has nothing of the kind).

One `BufferPool` per stage-3 engine, shared by all its groups and buckets, keeps each buffer that
comes back (`give`) and hands it out again for the next request of the same size, dtype and
device (`take`). A gathered buffer freed in backward thus becomes the next bucket's staging buffer,
so gathered parameters plus staging cost the whole model plus about one staging buffer, and the
pool never holds more buffers of a size than were in use at once (it allocates only when it has
none free). Allocated once (in the first steps) and never freed while the engine lives, they no
longer leave unit-sized holes in the heap each step; `clear()` frees the idle ones (`Engine.destroy`).
Their contents are stale when taken, as `torch.empty`'s are: a gathered buffer is written whole
by its all-gather, a staging buffer as [Note: no gradient memset] in bucket.py says.

A buffer is handed out again only when nothing else holds its storage; it is never handed out
while still in use. One that comes back still held waits aside (`_waiting`) and joins the free
buffers once its holder lets go. Most such holds are brief: in most runs of a 4-step stage-3 test
on the tiny GPT, a gathered unit's buffer came back while something still held it, and 50 ms
later, with no garbage collection in between, nothing did (on the 25.5M benchmark model, in none
of 10 steps). The holder is gloo's worker thread: torch's `ProcessGroupGloo::runLoop` runs a work,
which marks it complete and wakes the waiter, and drops its own reference to the work (and with
it the tensors) only after taking its queue's lock again, so `wait()` can return first. Dropping
such a buffer made the pool allocate another and left the hole in the heap it is there to avoid.
Other holders (a view that autograd kept, e.g. with `retain_graph=True`, or that the user took)
may hold on for long: at most `MAX_WAITING` buffers wait, and the oldest beyond that is dropped,
to be freed when its last holder lets go, exactly as without the pool.
"""

from __future__ import annotations

import torch

from zerodist import compat

_Key = tuple[int, torch.dtype, torch.device]
MAX_WAITING = 8


class BufferPool:
    """Free flat buffers by (numel, dtype, device), for stage 3's gathers and gradient staging."""

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._waiting: list[torch.Tensor] = []  # given back while something else still held them
        self._use_count = compat.storage_use_counter()  # None: no reuse, see compat
        self.allocated_bytes = 0  # every buffer this pool allocated and has not dropped: handed out or kept
        self.peak_bytes = 0
        self.reused = 0  # requests served from the pool (for reports and tests)
        self.held_when_given = 0  # buffers that came back still held elsewhere (for reports and tests)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of `numel` elements with stale contents: a free one if any, else a new one."""
        self._collect_waiting()
        free = self._free.get((numel, dtype, _normalized(torch.device(device))))
        if free:
            self.reused += 1
            return free.pop()
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.allocated_bytes += _nbytes(buffer)
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`) is no longer used by its taker: keep it for the next request, or, while
        something else still holds its storage, aside until that lets go. The caller must drop its
        own references after this."""
        if self._use_count is None:  # cannot tell whether it is free: never hand it out again
            self.allocated_bytes -= _nbytes(buffer)
            return
        if self._held_elsewhere(buffer):
            self.held_when_given += 1
            self._waiting.append(buffer)
            if len(self._waiting) > MAX_WAITING:
                self.allocated_bytes -= _nbytes(self._waiting.pop(0))  # freed with its last holder
            return
        self._free.setdefault(_key(buffer), []).append(buffer)

    def _held_elsewhere(self, buffer: torch.Tensor) -> bool:
        # Held by `buffer` and by the storage's Python wrapper that the count itself creates: no one else.
        assert self._use_count is not None, "give() keeps no buffer without a use count"
        return self._use_count(buffer) > 2

    def _collect_waiting(self) -> None:
        """Move the waiting buffers that nothing else holds any more to the free ones."""
        if not self._waiting:
            return
        still = []
        for buffer in self._waiting:
            if self._held_elsewhere(buffer):
                still.append(buffer)
            else:
                self._free.setdefault(_key(buffer), []).append(buffer)
        self._waiting = still

    @property
    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers held by the pool alone, ready to hand out."""
        self._collect_waiting()
        return [b for buffers in self._free.values() for b in buffers]

    @property
    def free_bytes(self) -> int:
        """Bytes held by the pool alone, ready to hand out."""
        return sum(_nbytes(b) for b in self.free_buffers)

    @property
    def waiting_bytes(self) -> int:
        """Bytes given back while something else still holds them."""
        self._collect_waiting()
        return sum(_nbytes(b) for b in self._waiting)

    def clear(self) -> None:
        """Let go of every buffer not handed out: the free ones are freed, the waiting ones when their
        holders let go (those handed out are freed when given back or dropped)."""
        self.allocated_bytes -= self.free_bytes + sum(_nbytes(b) for b in self._waiting)
        self._free.clear()
        self._waiting.clear()


def _key(buffer: torch.Tensor) -> _Key:
    return (buffer.numel(), buffer.dtype, buffer.device)


def _normalized(device: torch.device) -> torch.device:
    """The device a tensor created on `device` reports (cuda -> cuda:N), as `give` keys by it."""
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.empty(0, device=device).device  # no memory: zero elements


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
