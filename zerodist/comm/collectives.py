"""Collectives: torch.distributed's signatures, one safe path.

Each function (1) initialises the world on first use through `init_distributed()`, (2) runs
any pre-collective checks (the desync guard), (3) issues the collective inside
`record_function("zerodist::<op>")` so it is labelled in profiles, (4) records it in active
traces, and (5) returns a `CommHandle`: the result tensor and, for `async_op=True`, the work
handle to `wait()` on. Synchronous calls return an already-completed handle.

torch's API churn stays here: torch 2.13 deprecates `all_gather_into_tensor` /
`reduce_scatter_tensor` in favour of `all_gather_single` / `reduce_scatter_single`, and older
torch has only the former. gloo has no `ReduceOp.AVG`; we emulate it as SUM then divide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from zerodist import compat
from zerodist.comm import nodes, timeline, tracer
from zerodist.comm.init import ensure_initialized, get_global_rank
from zerodist.comm.watchdog import Ticket, watchdog

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup
# A process group as every collective takes it: None is the world (torch.distributed's convention).
Group: TypeAlias = "dist.ProcessGroup | None"

_all_gather_impl = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_impl = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Checks run before every collective (op name, tensor or None, group); the desync guard
# registers here. Empty by default, so the cost is one truthiness test.
pre_collective_hooks: list[Callable[[str, torch.Tensor | None, Any], None]] = []


class CommHandle:
    """The result of a collective: `tensor` (or None) and its pending work, if any."""

    __slots__ = ("tensor", "_work", "_after_wait", "_ticket")

    def __init__(self, tensor: torch.Tensor | None, work: Any = None, after_wait: Callable[[], None] | None = None,
                 ticket: Ticket | None = None):
        self.tensor = tensor
        self._work = work
        self._after_wait = after_wait
        self._ticket = ticket  # what the hang watchdog calls this collective while wait() blocks
        if work is None and after_wait is not None:
            after_wait()
            self._after_wait = None

    def wait(self) -> torch.Tensor | None:
        """Block until the collective is done; returns the result tensor. Safe to call twice."""
        if self._work is not None:
            with watchdog.blocked(self._ticket):
                if tracer.blocked_meters:  # [Note: blocked time] in tracer.py
                    start = tracer.now()
                    self._work.wait()
                    tracer.add_blocked(tracer.now() - start)
                else:
                    self._work.wait()
            self._work = None
            if self._after_wait is not None:
                self._after_wait()
                self._after_wait = None
        return self.tensor

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _needs_avg_emulation(op: Any, group: Group) -> bool:
    return op == ReduceOp.AVG and dist.get_backend(group) == "gloo"


def _issue(
    op_name: str,
    tensor: torch.Tensor | None,
    numel: int,
    group: Group,
    async_op: bool,
    launch: Callable[[bool], Any],
    after_wait: Callable[[], None] | None = None,
) -> CommHandle:
    ensure_initialized()
    if pre_collective_hooks:
        for hook in pre_collective_hooks:
            hook(op_name, tensor, group)
    ticket = watchdog.issue(op_name, group)  # [Note: watchdog cost] in watchdog.py
    if tracer.blocked_meters and not async_op:
        launch = _metered(launch)
    if not async_op:
        launch = _watched(launch, ticket)
    if timeline.recording:  # [Note: timeline cost] in timeline.py
        launch = timeline.collective(op_name, tensor, numel, ticket, launch)
    if not tracer.active_traces:
        # record_function costs ~90 us per call even with no profiler running (measured by
        # `zerodist bench comm`), so collectives are labelled only while a profiler records.
        if not compat.profiler_enabled():  # the common case: no label, no tracing, just the call
            work = launch(async_op)
            return CommHandle(tensor, work if async_op else None, after_wait, ticket)
        with record_function(f"zerodist::{op_name}"):
            work = launch(async_op)
        return CommHandle(tensor, work if async_op else None, after_wait, ticket)
    group_size = dist.get_world_size(group)
    link = nodes.link_of_group(group)
    if not tracer.timing_requested():
        with record_function(f"zerodist::{op_name}"):
            work = launch(async_op)
        tracer.record(op_name, tensor, numel, group_size, None, link)
        return CommHandle(tensor, work if async_op else None, after_wait, ticket)
    start = tracer.now()
    with record_function(f"zerodist::{op_name}"), watchdog.blocked(ticket):
        work = launch(True)
        if work is not None:
            work.wait()
    if tensor is not None and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    duration = tracer.now() - start
    tracer.record(op_name, tensor, numel, group_size, duration, link)
    if tracer.blocked_meters:  # a timed trace makes every collective block where it is issued
        tracer.add_blocked(duration)
    return CommHandle(tensor, None, after_wait)


def _watched(launch: Callable[[bool], Any], ticket: Ticket) -> Callable[[bool], Any]:
    """`launch`, called synchronously while the hang watchdog knows where this thread waits."""

    def watched(async_op: bool) -> Any:
        with watchdog.blocked(ticket):
            return launch(async_op)

    return watched


def _metered(launch: Callable[[bool], Any]) -> Callable[[bool], Any]:
    """`launch`, adding the time a synchronous call blocks to the active meters ([Note: blocked
    time] in tracer.py). Called asynchronously (only by a timed trace, which meters the whole
    collective itself) it adds nothing."""

    def metered(async_op: bool) -> Any:
        if async_op:
            return launch(async_op)
        start = tracer.now()
        try:
            return launch(async_op)
        finally:
            tracer.add_blocked(tracer.now() - start)

    return metered


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False) -> CommHandle:
    """Reduce `tensor` in place across `group`."""
    ensure_initialized()
    after = None
    if _needs_avg_emulation(op, group):
        op, after = ReduceOp.SUM, _divide_by_group_size(tensor, group)
    return _issue(
        "all_reduce", tensor, tensor.numel(), group, async_op,
        lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), after,
    )


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False,
    *, input_is_scratch: bool = False,
) -> CommHandle:
    """Reduce `input` (group_size * output.numel() elements) and keep this rank's slice in `output`.

    `input_is_scratch=True`: the caller no longer needs `input`'s values, which lets gloo skip a
    copy ([Note: gloo reduce-scatter])."""
    ensure_initialized()
    _check_sizes("reduce_scatter", input.numel(), output.numel(), group, "input", "output")
    after = None
    if _needs_avg_emulation(op, group):
        op, after = ReduceOp.SUM, _divide_by_group_size(output, group)
    if input_is_scratch and input.is_contiguous() and dist.get_backend(group) == "gloo":
        return _issue("reduce_scatter", output, input.numel(), group, async_op,
                      lambda a: dist.all_reduce(input, op=op, group=group, async_op=a),
                      _then(_land_slice(output, input, group), after))
    return _issue(
        "reduce_scatter", output, input.numel(), group, async_op,
        lambda a: _reduce_scatter_impl(output, input, op=op, group=group, async_op=a), after,
    )


# [Note: gloo reduce-scatter] gloo has no reduce-scatter of its own: torch's gloo backend clones
# the input, all-reduces the clone and copies this rank's slice out (a 25 MiB bucket on 2 loaded
# ranks: about 45 ms of CPU against 31 ms for an in-place all-reduce plus the slice copy). When
# the caller's input is scratch (a gradient bucket, whose unreduced values nobody reads again),
# zerodist all-reduces it in place and copies the slice, or copies nothing when `output` already
# is that slice: the same sums (gloo runs the same all-reduce either way, so the bits agree), one
# clone fewer. The tracer still records a reduce-scatter of the same size: the collective that
# was asked for, and the one NCCL runs.
def _land_slice(output: torch.Tensor, input: torch.Tensor, group: Group) -> Callable[[], None]:
    rank, numel = dist.get_rank(group), output.numel()
    piece = input.view(-1)[rank * numel: (rank + 1) * numel]

    def land() -> None:
        if piece.data_ptr() != output.data_ptr():
            output.copy_(piece.view_as(output))
    return land


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()
    return both


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False) -> CommHandle:
    """Concatenate every rank's `input` into `output` (group_size * input.numel() elements)."""
    ensure_initialized()
    _check_sizes("all_gather", output.numel(), input.numel(), group, "output", "input")
    if _gathers_by_broadcast(output, input, group):
        return _issue("all_gather", output, output.numel(), group, async_op,
                      lambda a: _all_gather_by_broadcast(output, input, group, a))
    return _issue(
        "all_gather", output, output.numel(), group, async_op,
        lambda a: _all_gather_impl(output, input, group=group, async_op=a),
    )


# [Note: gloo all-gather] torch's gloo all-gather receives into a flat buffer of its own and
# copies that into `output` afterwards: a transient allocation of the whole output and a second
# pass over it. Measured on 2 loaded ranks for a 12.2 MiB output: 9-12 ms (6.5-11 ms of CPU),
# against 6 ms (3.5-4.5 ms of CPU) for one in-place broadcast per rank, each rank's slice straight
# from its owner into `output`; 4 ranks on 2 cores: 18 ms against 19-21 ms. The bytes are the
# same (each slice crosses to every other rank once) and so are the bits; the price is one
# collective per rank instead of one, so only small groups (up to 8 ranks, a judgement: more
# ranks than 4 were not measured) gather this way. The tracer records one all-gather, the collective that was asked for
# and the one NCCL runs.
_BROADCAST_GATHER_MAX_RANKS = 8


def _gathers_by_broadcast(output: torch.Tensor, input: torch.Tensor, group: Group) -> bool:
    if not (output.is_contiguous() and input.is_contiguous() and output.device.type == "cpu" and input.numel()):
        return False
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) > _BROADCAST_GATHER_MAX_RANKS:
        return False
    slot = output.view(-1)[dist.get_rank(group) * input.numel():][:input.numel()]
    # `input` is this rank's slot of `output` (an in-place gather) or lies wholly outside `output`
    if input.data_ptr() == slot.data_ptr():
        return True
    start, end = output.data_ptr(), output.data_ptr() + output.numel() * output.element_size()
    return input.data_ptr() + input.numel() * input.element_size() <= start or input.data_ptr() >= end


def _all_gather_by_broadcast(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool) -> Any:
    size, rank, numel = dist.get_world_size(group), dist.get_rank(group), input.numel()
    slots = output.view(-1).split(numel)
    if slots[rank].data_ptr() != input.data_ptr():
        slots[rank].copy_(input.view(-1))
    works = [dist.broadcast(slots[r], src=get_global_rank(group, r), group=group, async_op=True) for r in range(size)]
    joined = _JoinedWork(works)
    if async_op:
        return joined
    joined.wait()
    return None


class _JoinedWork:
    """Several torch works waited for as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> CommHandle:
    """Split `input` along dim 0, send split i to rank i, receive into `output`."""
    return _issue(
        "all_to_all", output, input.numel(), group, async_op,
        lambda a: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=a
        ),
    )


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> CommHandle:
    """Copy `tensor` from global rank `src` to every rank of `group`."""
    return _issue(
        "broadcast", tensor, tensor.numel(), group, async_op,
        lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a),
    )


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False) -> CommHandle:
    """Reduce `tensor` onto global rank `dst` (other ranks' tensors are left unspecified)."""
    ensure_initialized()
    after = None
    if _needs_avg_emulation(op, group):
        op = ReduceOp.SUM
        divide = _divide_by_group_size(tensor, group)
        after = (lambda: divide() if dist.get_rank() == dst else None)
    return _issue(
        "reduce", tensor, tensor.numel(), group, async_op,
        lambda a: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=a), after,
    )


def barrier(group: Group = None, async_op: bool = False) -> CommHandle:
    """Wait until every rank of `group` arrives."""
    return _issue("barrier", None, 0, group, async_op, lambda a: dist.barrier(group=group, async_op=a))


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """`object_list[i]` becomes rank i's `obj` (pickled; for small metadata, not tensors)."""
    _issue("all_gather_object", None, 0, group, False, lambda a: dist.all_gather_object(object_list, obj, group=group))


def broadcast_object_list(object_list: list[Any], src: int = 0, group: Group = None) -> None:
    """Replace `object_list`'s items with those of global rank `src`."""
    _issue(
        "broadcast_object_list", None, 0, group, False,
        lambda a: dist.broadcast_object_list(object_list, src=src, group=group),
    )


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Group = None) -> None:
    """Collect every rank's `obj` into `object_gather_list` on global rank `dst`."""
    _issue(
        "gather_object", None, 0, group, False,
        lambda a: dist.gather_object(obj, object_gather_list, dst=dst, group=group),
    )


def _divide_by_group_size(tensor: torch.Tensor, group: Group) -> Callable[[], None]:
    size = dist.get_world_size(group)

    def divide() -> None:
        tensor.div_(size)

    return divide


def _check_sizes(op: str, big: int, small: int, group: Group, big_name: str, small_name: str) -> None:
    size = dist.get_world_size(group)
    if big != small * size:
        raise ValueError(
            f"{op}: {big_name} has {big} elements but must have group size ({size}) x "
            f"{small_name} ({small}) = {small * size}"
        )
