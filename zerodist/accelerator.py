"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()``: the device this rank computes on.

    from zerodist.accelerator import get_accelerator        # DeepSpeed: from deepspeed.accelerator import ...
    device = get_accelerator().device_name(engine.local_rank)   # "cuda:0", or "cpu"

Only the members DeepSpeed's examples and tutorials call: device names and counts, bf16/fp16
support, ``synchronize``, memory queries, RNG seeding and the communication backend's name.
The answer is the device zerodist's engine trains on (``zerodist.comm.device_for_rank``): a GPU
of this rank's own under NCCL, else the CPU, decided by the same rule before the process group
exists. DeepSpeed picks among many accelerator kinds (XPU, HPU, NPU, MPS, ...); zerodist knows
CUDA and the CPU, so ``get_accelerator()`` takes no arguments and ``set_accelerator`` is absent.

[Note: transfers behind the accelerator] What zerodist itself asks of the device, beyond DeepSpeed's
names: whether a device is the host (`is_host`), host buffers that are pinned where the device
supports it (`host_empty`), and copy streams with events (`transfer_stream`) so that host<->device
copies overlap compute. On CUDA these are `torch.cuda.Stream` / `torch.cuda.Event` and pinned
memory; on the CPU a stream runs its work at once and an event is always complete (no-ops).

[Note: a simulated device] The CPU suite has no GPU (zerodist has run on one once: docs/gpu.md).
To run the device-copy code paths on the CPU, `simulated_device()` makes the CPU count as a device
distinct from the host: `is_host(cpu)` is then false, so host offload keeps its own host copies
and copies gradients out and parameters back exactly as it would from a GPU (through the no-op
streams). Tests turn it on around one run;
`ZERODIST_SIMULATED_DEVICE=1` turns it on for a whole process (a benchmark's ranks).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch

from zerodist.comm import init as comm_init


class Accelerator:
    """One rank's device, with DeepSpeed's accelerator method names."""

    def _is_cuda(self) -> bool:
        if comm_init.is_initialized():
            return comm_init.device_for_rank().type == "cuda"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return comm_init.choose_backend(local_rank, None) == "nccl"

    def random(self) -> Any:
        """torch's RNG module (`get_accelerator().random().fork_rng(...)`, as DeepSpeed's tests call it)."""
        return torch.random

    # ---------------------------------------------------------------- device
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:N"`` on a GPU, ``"cpu"`` on the CPU (DeepSpeed's CPU accelerator ignores the index)."""
        if not self._is_cuda():
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._is_cuda() else "cpu"

    def current_device(self) -> int:
        """The current GPU's index; on the CPU the local rank, as DeepSpeed's CPU accelerator says."""
        return torch.cuda.current_device() if self._is_cuda() else int(os.environ.get("LOCAL_RANK", "0"))

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._is_cuda() else 1

    def set_device(self, device_index: int) -> None:
        if self._is_cuda():
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True  # the CPU always is

    def synchronize(self, device_index: int | None = None) -> None:
        if self._is_cuda():
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        if comm_init.is_initialized():
            return comm_init.ensure_initialized().backend
        return "nccl" if self._is_cuda() else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._is_cuda() else True

    def is_fp16_supported(self) -> bool:
        return True  # zerodist's fp16 path (master weights, loss scaling) runs on the CPU too

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32] + [torch.bfloat16] * self.is_bf16_supported() + [torch.float16]

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == ("cuda" if self._is_cuda() else "cpu")

    # ---------------------------------------------------------------- host and transfers
    def is_host(self, device: torch.device) -> bool:
        """Whether tensors on `device` live in host memory ([Note: a simulated device]: not while simulated)."""
        return torch.device(device).type == "cpu" and not simulating()

    def pin_memory(self) -> bool:
        """Whether host buffers for this device's transfers are pinned (page-locked): on CUDA."""
        return self._is_cuda() and torch.cuda.is_available()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer for transfers to and from the device, pinned where `pin_memory()`."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin_memory())

    def transfer_stream(self, device: torch.device) -> TransferStream:
        """A stream for copies that overlap `device`'s compute ([Note: transfers behind the accelerator])."""
        return TransferStream(torch.device(device))

    # ---------------------------------------------------------------- memory (bytes)
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._is_cuda() else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._is_cuda():
            return torch.cuda.max_memory_allocated(device_index)
        # getrusage's peak is sampled by the kernel and can trail the current size by a few pages.
        return max(_peak_rss_bytes(), _rss_bytes())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._is_cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        if self._is_cuda():
            torch.cuda.empty_cache()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._is_cuda():
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._is_cuda():
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._is_cuda() else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._is_cuda() else torch.manual_seed(seed)

    def __repr__(self) -> str:
        return f"Accelerator({self.device_name()!r}, backend={self.communication_backend_name()!r})"


class TransferEvent:
    """A point in a transfer stream: `wait_host()` blocks the host until the work before it is done,
    `wait_compute()` makes the device's compute stream wait for it. Always complete off CUDA."""

    def __init__(self, event: Any = None):
        self._event = event

    def wait_host(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait_compute(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())


class TransferStream:
    """Copies issued `inside()` run on a side stream of a CUDA device, after the compute issued so far
    (`start_after_compute()`), and overlap the compute issued later; off CUDA they run at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def asynchronous(self) -> bool:
        """Whether copies issued inside run asynchronously (`non_blocking` copies are safe only then)."""
        return self._stream is not None

    def start_after_compute(self) -> None:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> TransferEvent:
        if self._stream is None:
            return TransferEvent()
        event = torch.cuda.Event()
        event.record(self._stream)
        return TransferEvent(event)


_SIMULATED: list[bool] = []


def simulating() -> bool:
    """Whether the CPU counts as a device distinct from the host now ([Note: a simulated device])."""
    return bool(_SIMULATED) or os.environ.get("ZERODIST_SIMULATED_DEVICE", "") == "1"


@contextlib.contextmanager
def simulated_device() -> Iterator[None]:
    """Within this block the CPU is a device distinct from the host ([Note: a simulated device])."""
    _SIMULATED.append(True)
    try:
        yield
    finally:
        _SIMULATED.pop()


def _rss_bytes() -> int:
    # The resident set of this process, as DeepSpeed's CPU accelerator reports memory_allocated.
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak is the best figure there is
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


_ACCELERATOR = Accelerator()


def get_accelerator() -> Accelerator:
    """This process's accelerator (one object; it holds no state of its own)."""
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """DeepSpeed asks whether its accelerator kind is one it supports; zerodist's (CUDA or the CPU) always is."""
    return True
