"""``deepspeed.ops.adagrad`` under ``import deepspeed`` served by zerodist: ``DeepSpeedCPUAdagrad`` (as torch's
Adagrad, cpu_optimizers.py), DeepSpeed's one name here."""

from __future__ import annotations

from typing import Any

from zerodist.runtime.ops.cpu_optimizers import DeepSpeedCPUAdagrad, not_served

__all__ = ["DeepSpeedCPUAdagrad"]
__path__: list[str] = []  # a package in DeepSpeed: its submodules are refused by the finder

_DEEPSPEED_NAMES = frozenset({"cpu_adagrad"})


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise not_served("deepspeed.ops.adagrad", name, _DEEPSPEED_NAMES, "DeepSpeedCPUAdagrad")
