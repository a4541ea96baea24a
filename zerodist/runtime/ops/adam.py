"""``deepspeed.ops.adam`` under ``import deepspeed`` served by zerodist: ``DeepSpeedCPUAdam`` (as torch's
Adam/AdamW, cpu_optimizers.py). DeepSpeed's other names here (``FusedAdam``, the ZenFlow optimizers and
its submodules) are refused by name."""

from __future__ import annotations

from typing import Any

from zerodist.runtime.ops.cpu_optimizers import DeepSpeedCPUAdam, not_served

__all__ = ["DeepSpeedCPUAdam"]
__path__: list[str] = []  # a package in DeepSpeed: its submodules are refused by the finder

_DEEPSPEED_NAMES = frozenset({"FusedAdam", "ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3",
                              "cpu_adam", "fused_adam", "multi_tensor_apply", "zenflow_cpu_adam",
                              "zenflow_torch_adam"})


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise not_served("deepspeed.ops.adam", name, _DEEPSPEED_NAMES, "DeepSpeedCPUAdam")
