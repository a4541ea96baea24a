"""accelerate's DeepSpeed path on a machine without GPUs, under ``zerodist run --as-deepspeed``.

[Note: accelerate's DeepSpeed path on the CPU]
accelerate (1.x) picks the process group's backend from the device kinds it finds (CUDA, XPU,
NPU, HPU, ...). With ``TrainingArguments(deepspeed=...)`` on a machine that has none, it finds no
backend, so it decides there is no distributed training: every rank believes it is alone, reads
the whole data set and sizes the batch for a world of 1, and DeepSpeed (or zerodist) then refuses
the batch arithmetic. ``use_cpu=True`` is no way out: it turns the DeepSpeed path off (DDP).
zerodist trains on gloo and the CPU first-class, so when it serves ``import deepspeed`` it
completes accelerate's choice there: a DeepSpeed launch (``ACCELERATE_USE_DEEPSPEED``) under a
launcher (``LOCAL_RANK``), not on the CPU by request, with no backend found and no CUDA, gets
``gloo``. Nothing else of accelerate changes; on a GPU machine this never applies. It is done when
``accelerate.state`` is imported (this finder wraps that module's loader), before any state exists.
"""

from __future__ import annotations

import importlib.machinery
import os
from typing import Any

from zerodist.integrations import import_patch

_PATCHED = "_zerodist_cpu_backend"


def patched_spec(finder: Any, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
    """`accelerate.state`'s own spec, its loader wrapped to complete the backend choice after it runs."""
    return import_patch.patched_spec(finder, fullname, path, target,
                                     lambda module: complete_backend_choice(module.PartialState, module.DistributedType))


def complete_backend_choice(partial_state: type, distributed_type: Any) -> None:
    """Wrap `PartialState._prepare_backend`: gloo where accelerate found no backend for a DeepSpeed launch on the CPU."""
    original = partial_state.__dict__.get("_prepare_backend")
    if original is None or getattr(original, _PATCHED, False):
        return

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and not cpu and _deepspeed_launch_without_gpu():
            return "gloo", kind if kind is not None else distributed_type.NO
        return chosen, kind

    setattr(_prepare_backend, _PATCHED, True)
    partial_state._prepare_backend = _prepare_backend  # type: ignore[attr-defined]


def _deepspeed_launch_without_gpu() -> bool:
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    if int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        return False
    import torch

    return not torch.cuda.is_available()
