"""`HostOffloadedOptimizer`: ZeRO-Offload, the optimizer on the host for parameters on an accelerator.

    step():  gradients -> host          each stepped tensor's gradient (its reduced, scaled shard) and
                                        its values are copied into host buffers (pinned on CUDA) on a
                                        transfer stream, all of them issued at once
             wave by wave               the host waits for a wave's copies only, steps the inner
                                        optimizer on the wave's host values (torch's fused CPU AdamW
                                        from a GPU, foreach under simulated_device(), unless the user
                                        chose; [Note: the host step's kernels]), and issues the copies
                                        of the new values back to the device; the next wave's gradient
                                        copies and the last wave's value copies overlap that step
             values -> device           before step() returns the compute stream waits for the last
                                        copy, so the schedule's gathers and the next forward see them

`offload_optimizer: {"device": "cpu"}` with parameters on an accelerator. The inner optimizer is
built over the device tensors zerodist steps (ZeRO's flat shards, or the fp32 master under
bf16/fp16), so its `param_groups` name them (a checkpoint, a scheduler see nothing change); its
per-element state lives on the host, keyed by those device tensors, and each tensor's values are
copied to a host buffer at each step and stepped there, so whatever wrote them on the device
between steps (a checkpoint load, a modifier rank, the user through a parameter, whose in-place
counter is not the flat buffer's) is what the host steps: 4 more bytes per element each way than
the gradient alone, against no stale value ever. The arithmetic is the inner optimizer's own on the same operands,
so the result is bitwise the in-device step's wherever the host and the device compute alike (the
CPU under `zerodist.accelerator.simulated_device()`, which is how the tests run this path).

The class is named after the inner optimizer's (an offloaded AdamW is an `AdamW` to a
checkpoint), as `SwappedOptimizer` is; its state_dict holds host tensors and loads anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zerodist.accelerator import TransferEvent, TransferStream, get_accelerator
from zerodist.offload.wrapped import WrappedOptimizer

WAVE_NUMEL = 4_000_000  # elements stepped at once: big enough for foreach, small enough to overlap copies


@dataclasses.dataclass
class _Slot:
    """One stepped device tensor and its host copies."""

    device: torch.Tensor
    values: torch.Tensor  # the host copy that is stepped
    grad: torch.Tensor  # the host buffer its gradient is copied into


@dataclasses.dataclass
class TransferCounters:
    """Bytes host offload moved, all steps (what a test and a benchmark read)."""

    to_host: int = 0
    to_device: int = 0
    steps: int = 0


_CLASSES: dict[type, type] = {}


def host_offloaded(inner: torch.optim.Optimizer, device: torch.device,
                   wave_numel: int = WAVE_NUMEL) -> HostOffloadedOptimizer:
    """`inner` (built over device tensors) stepped on the host."""
    cls = type(inner)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (HostOffloadedOptimizer,), {
            "__module__": __name__, "__qualname__": f"HostOffloadedOptimizer[{cls.__name__}]"})
    optimizer: HostOffloadedOptimizer = _CLASSES[cls](inner, device, wave_numel)
    return optimizer


# Optimizers whose fused kernel runs on the CPU (torch 2.4 and later): one pass over the state per
# element instead of one per operation.
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def prefer_foreach(inner: torch.optim.Optimizer) -> None:
    """Torch's foreach kernels on the host where the user chose no implementation: bitwise its
    for-loop on the CPU, and faster (torch picks foreach by itself on CUDA only). Fused is the
    user's choice: it rounds differently from the in-device step."""
    for group in inner.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def prefer_host_kernels(inner: torch.optim.Optimizer, device: torch.device) -> None:
    """[Note: the host step's kernels] Where the user chose no implementation: torch's fused CPU
    kernel when the parameters are on a real accelerator, foreach otherwise.

    A GPU's AdamW and the host's never round alike, so a host step from a GPU cannot be bitwise the
    in-device one whichever kernel it takes (the GPU tier checks 1e-6); the fused kernel reads and
    writes each element once where foreach makes a pass per operation. On the first GPU run (H200,
    16 host cores, 25.5M parameters) foreach's elementwise passes were the host step's largest part,
    12 ms of a 50-70 ms step. Under `simulated_device()` (the CPU as the device) foreach keeps the host
    step bitwise the in-device one, which is what the CPU tests check."""
    fused = device.type != "cpu" and isinstance(inner, _FUSED_ON_CPU)
    for group in inner.param_groups:
        chosen = group.get("foreach") is not None or group.get("fused")
        if fused and "fused" in group and not chosen and not group.get("differentiable"):
            group["fused"], group["foreach"] = True, False
    prefer_foreach(inner)


class HostOffloadedOptimizer(WrappedOptimizer):
    """Steps `inner` on host copies of its device tensors ([module docstring])."""

    def __init__(self, inner: torch.optim.Optimizer, device: torch.device, wave_numel: int = WAVE_NUMEL):
        super().__init__([torch.zeros(1, device="cpu")], inner.defaults)  # a placeholder group, as SwappedOptimizer's
        self.inner, self.device, self.wave_numel = inner, torch.device(device), wave_numel
        accelerator = get_accelerator()
        self.stream: TransferStream = accelerator.transfer_stream(self.device)
        self.counters = TransferCounters()
        self.slots: list[_Slot] = []
        for tensor in (t for group in inner.param_groups for t in group["params"]):
            if tensor.dim() != 1:
                raise ValueError(f"host offload steps flat tensors (zerodist's shards); got a {tensor.dim()}-d one")
            values = accelerator.host_empty(tensor.numel(), tensor.dtype)
            grad = accelerator.host_empty(tensor.numel(), tensor.dtype)
            self.slots.append(_Slot(tensor, values, grad))
        prefer_host_kernels(inner, self.device)

    # ------------------------------------------------------------------ torch.optim.Optimizer's surface
    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state if "inner" in self.__dict__ else self.__dict__.setdefault("_placeholder_state", {})

    @state.setter
    def state(self, value: Any) -> None:
        if "inner" in self.__dict__:
            self.inner.state = value

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Through the inner optimizer (its casts put the state on the device tensors' device), then
        every per-element state tensor back to host memory."""
        self.inner.load_state_dict(state_dict)
        accelerator = get_accelerator()
        for state in self.inner.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not _on_host(value):
                    host = accelerator.host_empty(value.numel(), value.dtype)
                    state[key] = host.copy_(value.reshape(-1)).view(value.shape)

    def resident_state_bytes(self) -> int:
        """Bytes of per-element state on the device: none (it is on the host; `host_state_bytes` counts it)."""
        return 0

    def host_state_bytes(self) -> int:
        """Bytes on the host: the per-element state, the stepped values' and the gradients' host copies."""
        state = sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return state + sum(2 * s.values.numel() * s.values.element_size() for s in self.slots)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("a host-offloaded optimizer takes no closure (zerodist's engine never passes one)")
        stream, non_blocking = self.stream, self.stream.asynchronous
        stream.start_after_compute()  # the gradients (and any value written on the device) are final
        arrived: list[TransferEvent | None] = []
        with stream.inside():
            for slot in self.slots:
                grad = slot.device.grad
                if grad is None:  # torch skips a tensor without a gradient; so does its host copy
                    arrived.append(None)
                    continue
                # The values too: whatever wrote them on the device since the last step (a load, a
                # modifier rank, the user through a parameter) is what the host steps.
                slot.values.copy_(slot.device.detach(), non_blocking=non_blocking)
                slot.grad.copy_(grad.detach().reshape(-1), non_blocking=non_blocking)
                self.counters.to_host += 2 * slot.grad.numel() * slot.grad.element_size()
                arrived.append(stream.record())
        for wave in self._waves(arrived):
            for index in wave:
                event = arrived[index]
                assert event is not None
                event.wait_host()
            self._step_wave(wave)
            with stream.inside():
                for index in wave:
                    slot = self.slots[index]
                    slot.device.detach().copy_(slot.values, non_blocking=non_blocking)
                    self.counters.to_device += slot.values.numel() * slot.values.element_size()
        stream.record().wait_compute()  # the values are back before anything on the device reads them
        self.counters.steps += 1

    def _waves(self, arrived: list[TransferEvent | None]) -> list[list[int]]:
        """Indices of the tensors with gradients, cut into runs of about `wave_numel` elements."""
        waves: list[list[int]] = [[]]
        filled = 0
        for index, event in enumerate(arrived):
            if event is None:
                continue
            if waves[-1] and filled + self.slots[index].values.numel() > self.wave_numel:
                waves.append([])
                filled = 0
            waves[-1].append(index)
            filled += self.slots[index].values.numel()
        return [wave for wave in waves if wave]

    def _step_wave(self, wave: list[int]) -> None:
        """The inner optimizer's step over these tensors' host copies only (state keyed by the host
        copies while it runs, by the device tensors again after)."""
        chosen = {id(self.slots[i].device): self.slots[i] for i in wave}
        saved = [group["params"] for group in self.inner.param_groups]
        state = self.inner.state
        for slot in chosen.values():
            slot.values.grad = slot.grad
            if slot.device in state:
                state[slot.values] = state.pop(slot.device)
        try:
            for group in self.inner.param_groups:
                group["params"] = [chosen[id(t)].values for t in group["params"] if id(t) in chosen]
            self.inner.step()
        finally:
            for group, original in zip(self.inner.param_groups, saved):
                group["params"] = original
            for slot in chosen.values():
                slot.values.grad = None
                if slot.values in state:
                    state[slot.device] = state.pop(slot.values)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"
