"""Point-to-point messages between pipeline stages: tensors sent with a header that names them.

    handle = send_message(tensors, dst, label=(kind, stage, microbatch))     # non-blocking
    tensors = recv_message(src, label=(kind, stage, microbatch), timeout_s=...)
    message = IncomingMessage(src, label=..., describe=...)                   # header posted ahead
    send(t, dst) / recv(t, src) / isend / irecv                               # the plain forms

[Note: p2p headers] gloo matches a receive by (source, tag) only, and a receive must be posted
with the right number of bytes. A receiver that guesses a shape from its own side (the first
micro-batch's, or the model's) turns a stage that sends another shape or dtype into garbage or
a hang. So every message is a fixed-size header (a magic number, a status, the sender's label
for the message, and the dtype and shape of each tensor) on `HEADER_TAG`, then the tensors on
`PAYLOAD_TAG`. The receiver waits for the header, checks the label against the one its schedule
expects and the dtype/shape against what it expects (when it knows: an output gradient must
match the output it sent), allocates, and receives the payload: a mismatch is a
`PipeMessageError` naming both sides, on the receiving rank, before any byte of payload is read.
Headers and payloads each keep their order between two ranks (gloo's pairs are FIFO per tag).
Every header travels in a message of MESSAGE_BYTES (header words, then an inline area): when a
message's tensors fit in INLINE_BYTES together they ride in it (each at a 16-byte-aligned offset)
and no payload message follows, so a small activation or gradient costs one message, not two;
larger ones follow on `PAYLOAD_TAG`. On this shared machine that took the one-way latency of a
small message from ~3 ms to ~0.4-0.8 ms (benchmarks/pipe_executor_bench.py's ping-pong).

[Note: receives posted ahead] gloo's TCP pairs move a message only once its receive is posted
(the receiver tells the sender it is ready), so a receive posted when the receiver reaches it
costs a round trip for the header and another for the payload, while the sender's data waits.
`IncomingMessage` posts the header's receive early (the pipeline executor posts every header of a
run at its start, in the schedule's message order); whenever the header has arrived the
receiver can `open()` it (check it, allocate, post the payload's receives) between two pieces of
work, so by the time it needs the tensors they are usually there. The checks are the same as
`recv_message`'s, at `open()`: nothing is read into a buffer before its header is checked. An
abort header matches whichever header receive is posted next, so a posted-ahead receive reports
a failed neighbour as soon as it is polled.

A rank whose pipeline work fails sends an abort header to its neighbours (`send_abort`): a
neighbour waiting for a message from it raises `PipePeerFailedError` at once instead of waiting
for the timeout, and passes the abort on, so every stage fails by name. A neighbour that died
closes its connection, which gloo reports at once (`CollectiveError`, named by the watchdog);
one that is alive but stuck is a `PipeTimeoutError` after `timeout_s`.

[Note: one header device] A header's send and its receive must be on one device: gloo moves CPU
tensors, NCCL only its rank's GPU's. `header_device()` (the device the rank communicates on:
`comm.device_for_rank()`) is where every header is built and received: the sender's message,
the receiver's header buffer and an abort alike, whatever device the payload is on (an inline
payload is copied into and out of the header's message). Before, the sender's header followed
the payload's device while the receiver's buffer and the abort stayed on the CPU, so a payload
on a GPU would have sent a header the receiver could not match. Received payloads land on the
header device too (unless the caller names another), so on NCCL a stage receives GPU tensors.

[Note: p2p on NCCL] NCCL ignores tags: it matches a pair's sends and receives in the order each
side posts them, on one stream per pair. Receives posted ahead (every header at the start) would
match a header buffer to the previous message's payload, so `posts_ahead()` is False there and a
receiver posts each header, then its payloads, in the sender's order. A pipeline *across* ranks on
NCCL is still refused (zerodist/pipe/apply.py): with one stream per pair, a rank's send queued
before its receive of the reverse direction can wait on a peer doing the same (torch batches a
step's sends and receives for this), and no GPU has been lent to test a fix; a pipeline whose
stages all sit on one rank sends no message and runs on any device.

The payload is counted by the tracer as `send` (sender) and `recv` (receiver); headers as
`p2p_header`, so `trace.total_bytes("send")` is the activations and gradients moved. The
collective guard does not apply: the two sides of a message issue different calls by design,
and the header does the guard's job for messages.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerodist.comm import timeline, tracer
from zerodist.comm.init import device_for_rank, ensure_initialized
from zerodist.comm.watchdog import CollectiveError, CollectiveTimeoutError, Ticket, watchdog

__all__ = [
    "HEADER_TAG", "INLINE_BYTES", "IncomingMessage", "MAX_TENSORS", "PAYLOAD_TAG", "PipeMessageError",
    "PipePeerFailedError", "PipeTimeoutError",
    "SendHandle", "header_device", "irecv", "posts_ahead", "isend", "recv", "recv_message", "send", "send_abort", "send_message",
]

HEADER_TAG = 7301
PAYLOAD_TAG = 7302
MAX_TENSORS = 8  # tensors per message (a stage's output tuple)
MAX_DIMS = 8
_MAGIC = 0x5A_44_50_50  # "ZDPP"
_OK, _ABORT = 0, 1
_FIXED = 7  # magic, status, label (3), number of tensors, inline (1: the tensors follow in the header's message)
_PER_TENSOR = 2 + MAX_DIMS  # dtype code, ndim, dims
HEADER_LENGTH = _FIXED + MAX_TENSORS * _PER_TENSOR  # int64 words
_ALIGN = 16  # each inline tensor starts at a multiple of this (complex128's element size)
_INLINE_START = -(-HEADER_LENGTH * 8 // _ALIGN) * _ALIGN
INLINE_BYTES = 4096  # tensors up to this size in all travel inside the header's message
MESSAGE_BYTES = _INLINE_START + INLINE_BYTES  # what every header receive takes

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}

Label = tuple[int, int, int]  # what the message is, by the schedule: (kind, stage, microbatch)
Meta = tuple[tuple[int, ...], torch.dtype]
Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]  # a payload's receive buffer


class PipeMessageError(RuntimeError):
    """A stage received a message other than the one its schedule expects: another micro-batch,
    another kind, or tensors of another dtype or shape than it can use."""


class PipePeerFailedError(CollectiveError):
    """The pipeline stage this rank waits for failed (and said so) or left."""


class PipeTimeoutError(CollectiveTimeoutError):
    """The pipeline stage this rank waits for sent nothing within the timeout."""


@dataclasses.dataclass
class SendHandle:
    """The pending works of one message; keeps its tensors alive until `wait()`."""

    works: list[Any]
    tensors: list[torch.Tensor]
    peer: int

    def wait(self, timeout_s: float | None = None, timeout_setting: str | None = None) -> None:
        for work in self.works:
            _wait(work, Ticket("send", "pipe", _pair(self.peer), 0), timeout_s, timeout_setting=timeout_setting)
        self.works, self.tensors = [], []

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


# ---------------------------------------------------------------------------------------- the plain forms

def isend(tensor: torch.Tensor, dst: int, tag: int = 0, axis: str | None = None) -> SendHandle:
    """Send `tensor` to global rank `dst` without blocking; `.wait()` before changing it. `axis`
    labels its tracer record (the ring passes "sequence"; a pipeline's messages are "pipe")."""
    ensure_initialized()
    _record("send", tensor, axis)
    return SendHandle([dist.isend(tensor.contiguous(), dst=dst, tag=tag)], [tensor], dst)


def send(tensor: torch.Tensor, dst: int, tag: int = 0, timeout_s: float | None = None) -> None:
    isend(tensor, dst, tag).wait(timeout_s)


def irecv(tensor: torch.Tensor, src: int, tag: int = 0, axis: str | None = None) -> Any:
    """Post a receive into `tensor` from global rank `src`; returns the work (`wait()` it)."""
    ensure_initialized()
    _record("recv", tensor, axis)
    return dist.irecv(tensor, src=src, tag=tag)


def recv(tensor: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> torch.Tensor:
    _wait(irecv(tensor, src, tag), Ticket("recv", "pipe", _pair(src), 0), timeout_s)
    return tensor


# ---------------------------------------------------------------------------------------- messages

def send_message(tensors: Sequence[torch.Tensor], dst: int, *, label: Label) -> SendHandle:
    """Send `tensors` (at most MAX_TENSORS) to global rank `dst` with a header naming them
    ([Note: p2p headers]); non-blocking."""
    ensure_initialized()
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise PipeMessageError(f"a pipeline message carries 1 to {MAX_TENSORS} tensors, got {len(tensors)}; "
                               "return fewer tensors from a stage's last layer (pack them in one)")
    payload = [t.detach().contiguous() for t in tensors]
    header, inline = _encode(_OK, label, payload, header_device())
    try:  # gloo raises here at once when the peer's connection is closed
        works = [dist.isend(header, dst=dst, tag=HEADER_TAG)]
        _record("p2p_header", header, "pipe")
        for tensor in payload:
            if not inline:
                works.append(dist.isend(tensor, dst=dst, tag=PAYLOAD_TAG))
            _record("send", tensor, "pipe")
    except RuntimeError as error:
        raise PipePeerFailedError(
            f"rank {dist.get_rank()}: sending message {tuple(label)} to rank {dst} failed: that stage exited or "
            f"crashed; its log says why.\n{error}") from error
    return SendHandle(works, [header, *payload], dst)


def send_abort(dst: int, label: Label = (0, 0, 0)) -> None:
    """Tell global rank `dst` that this stage failed (best effort: never waits, never raises)."""
    try:
        header, _ = _encode(_ABORT, label, [], header_device())
        _ABORTS.append(dist.isend(header, dst=dst, tag=HEADER_TAG))
        _ABORTS.append(header)  # kept alive: the process is failing anyway
    except Exception:  # the peer may be gone already  # noqa: BLE001
        pass


_ABORTS: list[Any] = []


class IncomingMessage:
    """A message whose header receive is posted now, before the receiver needs it ([Note: receives
    posted ahead]); `open()` checks the header and posts the payload's receives, `tensors()` waits.

        message = IncomingMessage(src, label=(kind, stage, mb), describe="...", timeout_s=60)
        ...                                   # compute; `message.header_arrived()` polls
        tensors = message.tensors(expect)     # header checked, payload received

    Several may be posted from one source: gloo matches them in the order posted, so they must be
    posted in the order the sender sends (the schedule's message order). `allocate(shape, dtype,
    device)` gives the buffer a payload (one not inline) is received into: by default a new tensor;
    the pipeline executor passes its pool of reused buffers ([Note: receive buffer pool] in
    zerodist/pipe/executor.py). It must hand out a buffer nothing else reads or writes until the
    tensors are taken."""

    def __init__(self, src: int, *, label: Label, describe: str, timeout_s: float | None = None,
                 timeout_setting: str | None = None, device: torch.device | None = None,
                 allocate: Allocate | None = None):
        ensure_initialized()
        self.src, self.label, self.describe = src, tuple(label), describe
        self.timeout_s, self.timeout_setting = timeout_s, timeout_setting
        self.device = device or header_device()  # where the tensors are received
        self.allocate: Allocate = allocate or _new_buffer
        self._header = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=header_device())
        self._received: list[torch.Tensor] | None = None  # allocated once the header is checked
        self._works: list[Any] = []
        try:
            self._header_work: Any = dist.irecv(self._header, src=src, tag=HEADER_TAG)
        except RuntimeError as error:  # the peer's connection is already closed
            raise PipePeerFailedError(f"rank {dist.get_rank()}: waiting for {describe} (rank {src}) failed: that "
                                      f"stage exited or crashed; its log says why.\n{error}") from error

    @property
    def opened(self) -> bool:
        return self._received is not None

    def header_arrived(self) -> bool:
        """Non-blocking: whether `open()` would return without waiting (a failed receive counts)."""
        return self.opened or bool(self._header_work.is_completed())

    def open(self, expect: Sequence[Meta] | None = None) -> None:
        """Wait for the header (up to the timeout), check it against the label and `expect`, allocate
        the tensors and post their receives; a no-op once done."""
        if self._received is not None:
            return
        _wait(self._header_work, self._ticket(), self.timeout_s, self.describe, self.timeout_setting)
        status, sent_label, metas, inline = _decode(self._header, self.src, self.describe)
        if status == _ABORT:
            raise PipePeerFailedError(
                f"rank {dist.get_rank()}: waiting for {self.describe} (rank {self.src}), which failed (its log has "
                "the error); this stage stops too")
        if sent_label != self.label:
            raise PipeMessageError(
                f"rank {dist.get_rank()} expected {self.describe} (label {self.label}) from rank {self.src}, which "
                f"sent label {sent_label}: the two stages run different schedules or micro-batch counts; every "
                "rank must use the same pipeline config and gradient_accumulation_steps")
        if expect is not None:
            _check_expected(metas, expect, self.src, self.describe)
        if inline:  # small tensors came with the header: copied out, no payload message
            received = [view.clone().to(self.device) for view in _inline_views(self._header, metas)]
        else:
            received = [self.allocate(tuple(shape), dtype, self.device) for shape, dtype in metas]
            self._works = [dist.irecv(t, src=self.src, tag=PAYLOAD_TAG) for t in received]
        for tensor in received:
            _record("recv", tensor, "pipe")
        self._received = received

    def tensors(self, expect: Sequence[Meta] | None = None) -> list[torch.Tensor]:
        """The message's tensors: `open(expect)`, then wait for the payload (up to the timeout each)."""
        self.open(expect)
        assert self._received is not None
        for work in self._works:
            _wait(work, self._ticket(), self.timeout_s, self.describe, self.timeout_setting)
        self._works = []
        return self._received

    def _ticket(self) -> Ticket:
        return Ticket(f"recv {self.describe}", "pipe", _pair(self.src), 0)


def recv_message(src: int, *, label: Label, describe: str, expect: Sequence[Meta] | None = None,
                 timeout_s: float | None = None, timeout_setting: str | None = None,
                 device: torch.device | None = None) -> list[torch.Tensor]:
    """Receive the message `label` from global rank `src`: the header first, checked against
    `label` and `expect` (dtype and shape of each tensor, when known), then the tensors.
    `describe` names the message in errors ("the activation of micro-batch 2 from stage 0");
    `timeout_setting` the setting `timeout_s` came from, for the timeout's error."""
    return IncomingMessage(src, label=label, describe=describe, timeout_s=timeout_s, timeout_setting=timeout_setting,
                           device=device).tensors(expect)


def _check_expected(metas: list[Meta], expect: Sequence[Meta], src: int, describe: str) -> None:
    got = [(tuple(s), d) for s, d in metas]
    wanted = [(tuple(s), d) for s, d in expect]
    if got != wanted:
        show = lambda ms: ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in ms)
        raise PipeMessageError(
            f"rank {dist.get_rank()}: {describe} from rank {src} has tensors [{show(got)}], but this stage "
            f"needs [{show(wanted)}]; a gradient must match the output it is the gradient of: the stage "
            "after this one changed the shape or dtype of its input (cast or reshape inside the layer instead)")


# ---------------------------------------------------------------------------------------- plumbing

def _new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _pair(peer: int) -> tuple[int, ...]:
    return (dist.get_rank(), peer)


def _wait(work: Any, ticket: Ticket, timeout_s: float | None, describe: str | None = None,
          timeout_setting: str | None = None) -> None:
    """Wait for `work` up to `timeout_s` (None: the collective timeout); a timeout is a
    `PipeTimeoutError` whose one line names `timeout_setting`, the setting that gave the wait."""
    try:
        with watchdog.blocked(ticket):
            if timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout_s))
    except CollectiveTimeoutError as error:
        what = describe or ticket.op
        within = "the collective timeout" if timeout_s is None else f"{timeout_s:g} s"
        setting = f" ({timeout_setting} sets the wait)" if timeout_setting else ""
        # Not chained: the watchdog's own text names the collective timeout's settings, not this
        # wait's; its story (whom this rank waited for, the backend's error) is kept.
        raise PipeTimeoutError(
            f"rank {dist.get_rank()}: {what} did not arrive from rank {ticket.ranks[-1]} within {within}; that "
            f"stage is stuck or runs another schedule{setting}.\n{error.story}") from None
    except CollectiveError as error:
        raise PipePeerFailedError(
            f"rank {dist.get_rank()}: the connection to rank {ticket.ranks[-1]} failed while waiting for "
            f"{describe or ticket.op}: that stage exited or crashed; its log says why.\n{error}") from error


def posts_ahead() -> bool:
    """Whether receives may be posted ahead of the sender's earlier messages ([Note: p2p on NCCL]):
    gloo matches by tag, NCCL by order."""
    return ensure_initialized().backend == "gloo"


def header_device() -> torch.device:
    """The device every pipeline header is built and received on ([Note: one header device])."""
    return device_for_rank()


def _encode(status: int, label: Label, tensors: Sequence[torch.Tensor],
            device: torch.device) -> tuple[torch.Tensor, bool]:
    """The header's message (MESSAGE_BYTES of uint8 on `device`): the header words, then the tensors
    themselves when they fit in INLINE_BYTES together (one message instead of 1 + len(tensors));
    and whether they did."""
    words = [0] * HEADER_LENGTH  # built on the host, then one copy to the header's device
    metas: list[Meta] = []
    for index, tensor in enumerate(tensors):
        if tensor.dtype not in _DTYPE_CODES:
            raise PipeMessageError(f"pipeline messages cannot carry {tensor.dtype} tensors")
        if tensor.dim() > MAX_DIMS:
            raise PipeMessageError(f"pipeline messages carry tensors of at most {MAX_DIMS} dimensions, "
                                   f"got {tuple(tensor.shape)}")
        start = _FIXED + index * _PER_TENSOR
        words[start: start + 2 + tensor.dim()] = [_DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape]
        metas.append((tuple(tensor.shape), tensor.dtype))
    inline = bool(tensors) and _inline_end(metas) <= MESSAGE_BYTES
    words[:_FIXED] = [_MAGIC, status, *label, len(tensors), int(inline)]
    message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    message[:_INLINE_START].view(torch.int64)[:HEADER_LENGTH].copy_(torch.tensor(words, dtype=torch.int64))
    if inline:
        for view, tensor in zip(_inline_views(message, metas), tensors):
            view.copy_(tensor)
    return message, inline


def _inline_offsets(metas: Sequence[Meta]) -> list[int]:
    offsets, offset = [], _INLINE_START
    for shape, dtype in metas:
        offsets.append(offset)
        numel = 1
        for size in shape:
            numel *= size
        offset += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets + [offset]


def _inline_end(metas: Sequence[Meta]) -> int:
    return _inline_offsets(metas)[-1]


def _inline_views(message: torch.Tensor, metas: Sequence[Meta]) -> list[torch.Tensor]:
    """Each tensor's place in the message's inline area, as a tensor of its dtype and shape."""
    offsets = _inline_offsets(metas)
    views = []
    for (shape, dtype), start in zip(metas, offsets):
        numel = 1
        for size in shape:
            numel *= size
        views.append(message[start: start + numel * dtype.itemsize].view(dtype).view(shape))
    return views


def _decode(message: torch.Tensor, src: int, describe: str) -> tuple[int, Label, list[Meta], bool]:
    values = message[:_INLINE_START].view(torch.int64).tolist()
    if values[0] != _MAGIC:
        raise PipeMessageError(f"rank {dist.get_rank()}: the header of {describe} from rank {src} is not a "
                               "zerodist pipeline header: something else sends to this rank on the pipeline's tags")
    status, label, count, inline = values[1], (values[2], values[3], values[4]), values[5], bool(values[6])
    metas: list[Meta] = []
    for index in range(count):
        start = _FIXED + index * _PER_TENSOR
        ndim = values[start + 1]
        metas.append((tuple(values[start + 2: start + 2 + ndim]), _DTYPES[values[start]]))
    return status, label, metas, inline


def _record(op: str, tensor: torch.Tensor, axis: str | None = None) -> None:
    if tracer.active_traces:
        tracer.record(op, tensor, tensor.numel(), 2, None, label=axis)
    if timeline.recording:
        timeline.p2p_message(op, tensor)
