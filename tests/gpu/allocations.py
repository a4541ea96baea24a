"""Which tensors zerodist's hot paths create without naming a device.

Every allocation in zero/, offload/, pipe/, comm/, moe/, tensor_parallel/ and sequence/ must follow
the parameters' device (or name the host on purpose): a factory call without `device=` lands on
torch's default device, the CPU, which on a GPU is a silent host tensor in the step (or a device
mismatch error). A `TorchFunctionMode` sees each factory call with the arguments the caller wrote,
before torch fills in the default, and records the zerodist file and line of those without one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import zerodist

HOT_PATHS = ("zero", "offload", "pipe", "comm", "moe", "tensor_parallel", "sequence")
_ROOT = Path(zerodist.__file__).resolve().parent
FACTORIES: frozenset[Callable[..., Any]] = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.empty_strided,
    torch.randn, torch.rand, torch.randint, torch.eye, torch.linspace, torch.as_tensor,
})


class DevicelessAllocations(TorchFunctionMode):
    """Records `path:line` of each factory call without a device made from a zerodist hot path."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not _from_tensor(func, args):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename).resolve()
            if path.is_relative_to(_ROOT) and path.relative_to(_ROOT).parts[0] in HOT_PATHS:
                self.found.setdefault(f"{path.relative_to(_ROOT)}:{frame.f_lineno}", func.__name__)
        return func(*args, **kwargs)


def _from_tensor(func: Any, args: tuple) -> bool:
    # torch.tensor / as_tensor of a tensor keeps its device
    return func in (torch.tensor, torch.as_tensor) and bool(args) and isinstance(args[0], torch.Tensor)
