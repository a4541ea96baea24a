"""One way to complete a third-party module after it is imported under `--as-deepspeed`: its own
spec from the rest of `sys.meta_path`, with the loader wrapped so that `after(module)` runs once the
module's code has. Used by accelerate_on_cpu.py (accelerate.state) and trl_zero3.py
(trl.trainer.utils); nothing is written on any user object."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable


def patched_spec(finder: Any, fullname: str, path: Any, target: Any,
                 after: Callable[[Any], None]) -> importlib.machinery.ModuleSpec | None:
    """`fullname`'s own spec (found by the finders after `finder`), its loader wrapped to call
    `after(module)` once the module has run; None where no other finder has it."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, after)
            return spec
    return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, after: Callable[[Any], None]) -> None:
        self.inner, self.after = inner, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
