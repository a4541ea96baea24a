"""Memory per rank: what the device and the process hold, the model states by kind beside the
ZeRO formula, and a watch that warns when memory grows steadily step after step.

    memory_report(engine)                  this rank's MemoryReport (no collective)
    memory_report(engine, all_ranks=True)  every rank's (all_gather_object: a collective)
    LeakWatch(window=10).observe(step)     call once per step at the same point of the step

Config `"memory_breakdown": true` makes the engine log rank 0's report every
`steps_per_print` steps and run a `LeakWatch` over every optimizer step (on every rank).

[Note: what memory is measured] On a GPU: `torch.cuda.memory_allocated` / `memory_reserved` /
`max_memory_allocated`. On the CPU, resident memory (RSS) moves in pages, includes the
allocator's free lists and the interpreter, and rarely shrinks, so the leak watch and the
report use glibc's `mallinfo2()` where it exists: the bytes `malloc` has handed out and not
had back ("heap in use"), which is where CPU tensors live. Sampled at the same point of every
step, it is flat to the byte in a loop that does not leak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.debug.engine_view import TrainingEngine, state_of
from zerodist.debug.estimate import OPTIMIZER_STATES, PARAM_BYTES, MemoryEstimate, estimate_memory, formula
from zerodist.utils import format_bytes, get_logger, log_rank0
from zerodist.zero.state import zero_state_of

logger = get_logger(__name__)

MIB = 1024 * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not had back (glibc); None where unavailable."""
    function = _mallinfo2()
    if function is None:
        return None
    info = function()
    return int(info.uordblks + info.hblkhd)  # small blocks in use + large mmapped blocks


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def _cuda_device(engine: TrainingEngine | None) -> torch.device | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    zero = zero_state_of(engine)
    if zero is not None and zero.groups and zero.groups[0].device.type != "cuda":
        return None
    return torch.device("cuda", torch.cuda.current_device())


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """One rank's memory. CUDA fields are None without a GPU; `heap_in_use` None off glibc;
    model-state fields None without an engine."""

    rank: int
    rss: int
    peak_rss: int
    heap_in_use: int | None
    cuda_device: str | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak_allocated: int | None = None
    model_states: dict[str, int] | None = None  # engine.model_state_bytes(): params, grads, optimizer, total
    estimate: MemoryEstimate | None = None
    on_disk: int = 0  # optimizer state in swap files (offload_optimizer: nvme)

    def format(self) -> str:
        parts = [f"rank {self.rank} memory:"]
        if self.cuda_device is not None:
            parts.append(f"{self.cuda_device} allocated {format_bytes(self.cuda_allocated or 0)}, reserved "
                         f"{format_bytes(self.cuda_reserved or 0)}, peak {format_bytes(self.cuda_peak_allocated or 0)};")
        heap = "" if self.heap_in_use is None else f", heap in use {format_bytes(self.heap_in_use)}"
        parts.append(f"process RSS {format_bytes(self.rss)} (peak {format_bytes(self.peak_rss)}){heap}")
        if self.model_states is not None:
            m = self.model_states
            parts.append(f"; model states {format_bytes(m['total'])} = params {format_bytes(m['params'])} + grads "
                         f"{format_bytes(m['grads'])} + optimizer {format_bytes(m['optimizer'])}")
            if self.on_disk:
                parts.append(f"in memory, optimizer state {format_bytes(self.on_disk)} on disk (swap files)")
        if self.estimate is not None and self.model_states is not None:
            e = self.estimate
            verdict = "exact" if e.model_states == self.model_states["total"] else \
                f"measured {self.model_states['total'] - e.model_states:+,} bytes from it"
            parts.append(f"; ZeRO formula {formula(e.stage, e.dtype, e.optimizer, e.offload)} with Ψ={e.num_params:,} (padded), "
                         f"N={e.world_size}: {format_bytes(e.model_states)} ({verdict})")
        return " ".join(parts).replace(" ;", ";")


def padded_num_params(engine: TrainingEngine) -> int:
    """Ψ as the engine lays it out: every bucket padded to a multiple of N x 64 elements."""
    return state_of(engine).padded_num_params()


def optimizer_kind(optimizer: Any) -> str | None:
    """The estimator's name for a torch optimizer, None when it has no formula for it."""
    inner = optimizer
    while hasattr(inner, "inner"):  # ZeroOptimizer, and an offloading wrapper inside it (zerodist.offload)
        inner = inner.inner
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return None if any(g.get("amsgrad") for g in inner.param_groups) else "adam"
    if isinstance(inner, torch.optim.SGD) and all(g.get("momentum", 0) for g in inner.param_groups):
        return "sgd"
    return None


def estimate_for_engine(engine: TrainingEngine, **kwargs: Any) -> MemoryEstimate | None:
    """`estimate_memory` for this engine: its padded Ψ, world size, stage, precision, optimizer
    and bucket sizes, so the model states agree with `engine.model_state_bytes()` exactly (once
    the optimizer has stepped: Adam's states are created at the first step). `kwargs` go to
    `estimate_memory` (hidden=, layers=, seq_len=, micro_batch=, heads=, flash_attention=...).
    None for an optimizer the estimator has no formula for, parameters in several sharding
    domains (the formula has one N), or a dtype it has none for (fp64)."""
    state = state_of(engine)
    kind = optimizer_kind(state.optimizer)
    sizes = {g.world_size for g in [*state.groups, *state.frozen_groups]}
    if kind is None or kind not in OPTIMIZER_STATES or len(sizes) != 1 or state.precision.name not in PARAM_BYTES:
        return None
    zero = engine.config.zero_optimization
    kwargs.setdefault("reduce_bucket_size", zero.reduce_bucket_size)
    kwargs.setdefault("allgather_bucket_size", zero.allgather_bucket_size)
    if zero.offload_optimizer is not None:
        kwargs.setdefault("offload_optimizer", zero.offload_optimizer.device)
        kwargs.setdefault("buffer_count", zero.offload_optimizer.buffer_count)
    if zero.offload_param is not None and zero.offload_param.device == "nvme":
        kwargs.setdefault("offload_param", "nvme")
    kwargs.setdefault("sub_group_size", zero.sub_group_size)
    # stage 3's sharded frozen parameters (model_state_bytes counts them); at stages 0-2 frozen
    # parameters are the model's own, outside zerodist's state, and so outside this estimate
    kwargs.setdefault("frozen", sum(g.layout.total_numel for g in state.frozen_groups))
    return estimate_memory(state.padded_num_params(), world_size=sizes.pop(), stage=state.sharding.stage,
                           dtype=state.precision.name, optimizer=kind, **kwargs)


def memory_report(engine: TrainingEngine | None = None, *, all_ranks: bool = False, group: Group = None) -> Any:
    """This rank's `MemoryReport`; with `all_ranks`, a list of every rank's (a collective)."""
    cuda = _cuda_device(engine)
    report = MemoryReport(
        rank=comm.get_rank() if comm.is_initialized() else 0, rss=(rss := rss_bytes()), peak_rss=max(rss, peak_rss_bytes()),
        heap_in_use=heap_in_use(),
        cuda_device=None if cuda is None else str(cuda),
        cuda_allocated=None if cuda is None else torch.cuda.memory_allocated(cuda),
        cuda_reserved=None if cuda is None else torch.cuda.memory_reserved(cuda),
        cuda_peak_allocated=None if cuda is None else torch.cuda.max_memory_allocated(cuda),
        model_states=None if engine is None else state_of(engine).model_state_bytes(),
        estimate=None if engine is None else estimate_for_engine(engine),
        on_disk=0 if engine is None else state_of(engine).optimizer.swapped_state_bytes(),
    )
    if not all_ranks:
        return report
    everyone: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(everyone, report, group=group)
    return everyone


def default_measure(engine: TrainingEngine | None = None) -> tuple[str, Callable[[], int]]:
    """What the leak watch samples (see [Note: what memory is measured]): a name and a function."""
    cuda = _cuda_device(engine)
    if cuda is not None:
        return "CUDA allocated", functools.partial(torch.cuda.memory_allocated, cuda)
    if heap_in_use() is not None:
        return "heap in use", lambda: heap_in_use() or 0
    return "process RSS", rss_bytes


class LeakWatch:
    """Warns when memory grows steadily over a window of steps.

    `observe(step)` once per step, at the same point of every step. Over the last `window`
    samples it warns when memory grew by `min_growth_bytes` in all, rose at (at least) 3 in 4
    of the steps by a quarter of the mean rise or more, and never fell by more than that; the
    warning names the window's steps, and the watch starts a new window (one per window). One
    jump (a cache filling once) is not steady; nor is growth that is given back.
    """

    def __init__(self, window: int = 10, *, min_growth_bytes: int = MIB, measure: Callable[[], int] | None = None,
                 what: str | None = None):
        if window < 3:
            raise ValueError(f"LeakWatch needs a window of at least 3 steps, got {window}")
        default_what, default_measure_fn = default_measure() if measure is None else ("memory", measure)
        self.window, self.min_growth_bytes = window, min_growth_bytes
        self.measure, self.what = default_measure_fn, what or default_what
        self.samples: list[tuple[int, int]] = []
        self.warnings: list[str] = []

    def observe(self, step: int, value: int | None = None) -> str | None:
        """Record this step's memory (measured unless `value` is given); returns the warning, if any."""
        self.samples.append((step, self.measure() if value is None else value))
        del self.samples[:-self.window]
        if len(self.samples) < self.window or not self._steady():
            return None
        (first_step, first), (last_step, last) = self.samples[0], self.samples[-1]
        quarter = (last - first) / (self.window - 1) / 4
        rises = sum(b - a >= quarter for (_, a), (_, b) in zip(self.samples, self.samples[1:]))
        rank = comm.get_rank() if comm.is_initialized() else 0
        message = (f"memory leak on rank {rank}? {self.what} grew at {rises} of {self.window - 1} steps over the "
                   f"window of steps {first_step}-{last_step}: {format_bytes(first)} -> {format_bytes(last)} "
                   f"({format_bytes(last - first)} in all, {format_bytes((last - first) / (self.window - 1))} per step). "
                   "Something keeps a reference every step: a loss or output kept with its graph (log loss.item() "
                   "or loss.detach()), tensors appended to a list, hooks registered inside the loop.")
        logger.warning("%s", message)
        self.warnings.append(message)
        self.samples = [self.samples[-1]]  # a new window starts here
        return message

    def _steady(self) -> bool:
        """Grew by `min_growth_bytes`, at 3 in 4 steps by at least a quarter of the mean step's
        rise (tiny rises do not count: torch's own per-collective records grow the heap by
        ~1 KB per collective until they wrap), and never fell by more than that quarter."""
        values = [v for _, v in self.samples]
        deltas = [b - a for a, b in zip(values, values[1:])]
        growth = values[-1] - values[0]
        if growth < self.min_growth_bytes:
            return False
        quarter = growth / len(deltas) / 4
        return sum(d >= quarter for d in deltas) * 4 >= 3 * len(deltas) and min(deltas) >= -quarter


class MemoryMonitor:
    """What `"memory_breakdown": true` turns on in the engine: `on_step()` after every optimizer
    step feeds a `LeakWatch` (every rank) and, every `steps_per_print`, logs rank 0's report."""

    def __init__(self, engine: TrainingEngine, *, window: int = 10):
        self.engine = engine
        what, measure = default_measure(engine)
        self.leaks = LeakWatch(window, measure=measure, what=what)

    def on_step(self, step: int) -> None:
        self.leaks.observe(step)
        every = self.engine.config.steps_per_print
        if every and step % every == 0:
            log_rank0(logger, "step %d: %s", step, memory_report(self.engine).format())
