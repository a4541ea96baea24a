"""FLOPs per step counted from the model, the device's peak, and MFU.

    count = count_flops(lambda: train_step(), model)   # one step, counted while it runs
    count.total                                          # FLOPs this rank did in the step
    lines = format_flops_table(count, depth=2, top=5)    # per module, as DeepSpeed's profiler prints
    peak, source = device_peak(device, dtype)            # a known GPU's, or this CPU's measured matmul peak
    mfu = count.total / step_seconds / peak

[Note: counting FLOPs] `torch.utils.flop_counter.FlopCounterMode` counts the FLOPs of every matrix
product and convolution (matmul, addmm, bmm, scaled dot-product attention, ...) as the step runs,
attributed to the module whose forward or backward ran it; elementwise work (norms, activations,
the optimizer) is not counted, as in PaLM's and Megatron's MFU. A multiply-add is 2 FLOPs. For a
dense decoder that is close to 6 N per token (2N forward, 4N backward) plus attention's
12 L H Q T, so the count is checked against 6 N tokens in the tests. The FLOPs counted are the
ones this rank ran (a tensor-parallel rank's slice, a pipeline rank's stages), so the FLOP/s is
per rank and MFU divides it by one device's peak.

[Note: peak FLOP/s] Peaks are the vendors' dense (no sparsity) tensor-core numbers per dtype; fp32
on NVIDIA GPUs from Ampere on uses TF32's. A GPU missing from the table has no MFU (say so rather
than guess). On a CPU the peak is measured: large fp32 matrix products timed on this rank while
every rank does the same (`measure_matmul_peak`), so it is the share of the machine one rank gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from zerodist.compat import TorchDispatchMode

__all__ = ["FlopCount", "FlopSession", "session_open", "GPU_PEAK_FLOPS", "count_flops", "device_peak", "format_flops_table", "measure_matmul_peak"]

TERA = 1e12

# name fragment (lower case, as torch.cuda.get_device_name spells it) -> dtype -> dense FLOP/s
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp32": 494.7 * TERA},
    "h100": {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp32": 494.7 * TERA},  # SXM
    "a100": {"bf16": 312.0 * TERA, "fp16": 312.0 * TERA, "fp32": 156.0 * TERA},
    "l40s": {"bf16": 362.1 * TERA, "fp16": 362.1 * TERA, "fp32": 183.0 * TERA},
    "l4": {"bf16": 121.0 * TERA, "fp16": 121.0 * TERA, "fp32": 60.0 * TERA},
    "a10": {"bf16": 125.0 * TERA, "fp16": 125.0 * TERA, "fp32": 62.5 * TERA},
    "v100": {"fp16": 125.0 * TERA, "fp32": 15.7 * TERA},
    "mi300x": {"bf16": 1307.4 * TERA, "fp16": 1307.4 * TERA, "fp32": 163.4 * TERA},
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclasses.dataclass
class FlopCount:
    """FLOPs of one counted call: the total (forward, backward, everything), and each module's forward
    (its children included), as DeepSpeed's flops profiler attributes them."""

    total: int
    forward: dict[str, int]                # "blocks.0.attn" -> forward FLOPs; "" is the whole model
    params: dict[str, int]                 # the same names -> parameters (this rank's)
    latency: dict[str, float] = dataclasses.field(default_factory=dict)  # the same names -> forward seconds


class _Counter(TorchDispatchMode):
    """Sums torch's FLOP formulas over every op that has one ([Note: counting FLOPs])."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


_open_sessions = [0]  # FlopSessions made and not finished, in this process


def session_open() -> bool:
    """Whether a FLOP count is under way in this process (`zerodist train`'s around its profile step),
    so that another (the engine's own) does not count the same step twice."""
    return _open_sessions[0] > 0


class FlopSession:
    """A FLOP count spread over several calls (an engine's forwards and backwards of one step):
    `counting()` around each, `finish()` for the `FlopCount`. Each module of `module` gets its
    forwards' FLOPs and wall time from forward hooks (removed by `finish()`)."""

    def __init__(self, module: torch.nn.Module | None = None):
        self.counter = _Counter()
        self.forward: dict[str, int] = {}
        self.latency: dict[str, float] = {}
        self.module = module
        self._begun: dict[int, list[tuple[int, float]]] = {}
        self._handles: list[Any] = []
        self._depth = 0
        self._open = True
        _open_sessions[0] += 1
        for name, child in (module.named_modules() if module is not None else ()):
            self._handles += [child.register_forward_pre_hook(self._pre),
                              child.register_forward_hook(functools.partial(self._post, name=name))]

    def _pre(self, m: torch.nn.Module, args: Any) -> None:
        if self._depth:
            self._begun.setdefault(id(m), []).append((self.counter.total, time.perf_counter()))

    def _post(self, m: torch.nn.Module, args: Any, output: Any, name: str) -> None:
        if self._depth and self._begun.get(id(m)):
            flops, started = self._begun[id(m)].pop()
            self.forward[name] = self.forward.get(name, 0) + self.counter.total - flops
            self.latency[name] = self.latency.get(name, 0.0) + time.perf_counter() - started

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the FLOPs run inside (re-entrant: a nested block counts nothing twice)."""
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            with self.counter:
                yield
        finally:
            self._depth -= 1

    def finish(self, params: dict[str, int] | None = None) -> FlopCount:
        """The count so far; removes the hooks. `params` overrides the modules' parameter counts
        (a stage-3 shard holds a slice of each parameter: the engine passes the full sizes)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._open:
            self._open = False
            _open_sessions[0] -= 1
        if params is None:
            params = {name: sum(p.numel() for p in child.parameters()) for name, child in self.module.named_modules()} \
                if self.module is not None else {}
        return FlopCount(self.counter.total, dict(self.forward), params, dict(self.latency))


def count_flops(run: Callable[[], Any], module: torch.nn.Module | None = None) -> tuple[FlopCount, Any]:
    """Run `run()` once under the FLOP counter ([Note: counting FLOPs]); returns (count, its result).
    Each module of `module` gets its forward's FLOPs from hooks that read the running total."""
    session = FlopSession(module)
    try:
        with session.counting():
            result = run()
    finally:
        count = session.finish()
    return count, result


def format_flops_table(count: FlopCount, *, depth: int = 2, top: int = 0) -> list[str]:
    """Per module to `depth` (the model is depth 0), the largest `top` per parent (0: all), as
    DeepSpeed's flops profiler lists them: parameters, forward FLOPs, share of the model's forward."""
    whole = count.forward.get("", 0)
    timed = bool(count.latency)  # a FlopSession's count: each module's forward time too
    lines = [f"  {'module (forward)':<40}{'params':>13}{'GFLOPs':>11}{'share':>8}" + (f"{'fwd ms':>10}" if timed else "")]

    names = list(count.params) or list(count.forward)

    def children(name: str) -> list[str]:
        prefix = f"{name}." if name else ""
        return [c for c in names if c.startswith(prefix) and c != name and "." not in c[len(prefix):]]

    def flops(name: str) -> int:  # a container that is never called (a ModuleList): its items' sum
        return count.forward[name] if name in count.forward else sum(flops(c) for c in children(name))

    def latency(name: str) -> float:
        return count.latency[name] if name in count.latency else sum(latency(c) for c in children(name))

    def visit(name: str, level: int) -> None:
        label = ("  " * level + (name.rsplit(".", 1)[-1] if name else "model"))[:39]
        lines.append(f"  {label:<40}{count.params.get(name, 0):>13,}{flops(name) / 1e9:>11.3f}"
                     f"{flops(name) / whole if whole else 0:>8.1%}"
                     + (f"{latency(name) * 1e3:>10.2f}" if timed else ""))
        if level < depth:
            for child in sorted(children(name), key=lambda c: -flops(c))[:top or None]:
                visit(child, level + 1)

    if "" in count.forward:
        visit("", 0)
    return lines


def measure_matmul_peak(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of `size` x `size` matrix products on this process's CPU threads, best of repeated runs."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: threads, caches
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / max(time.perf_counter() - start, 1e-9))
    return best


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s of one `device` in `dtype`, where it comes from); None when unknown
    ([Note: peak FLOP/s])."""
    name = _DTYPE_NAMES.get(dtype, "fp32")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        for fragment, peaks in GPU_PEAK_FLOPS.items():
            if fragment in gpu.replace(" ", "") or fragment in gpu:
                peak = peaks.get(name)
                return peak, f"{torch.cuda.get_device_name(device)} {name} dense peak (table)"
        return None, f"{torch.cuda.get_device_name(device)} is not in zerodist.debug.flops.GPU_PEAK_FLOPS"
    if device.type == "cpu":
        measured_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        peak = measure_matmul_peak(measured_dtype)
        return peak, (f"this CPU's measured {_DTYPE_NAMES.get(measured_dtype, 'fp32')} matmul peak per rank "
                      f"({torch.get_num_threads()} thread(s))")
    return None, f"no peak known for device type {device.type!r}"
