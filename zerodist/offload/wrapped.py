"""The torch.optim.Optimizer surface shared by the optimizers offload wraps around a user's own
(`SwappedOptimizer`, `HostOffloadedOptimizer`): their `param_groups` are the inner optimizer's, so
schedulers and checkpoints see the user's groups."""

from __future__ import annotations

from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose `param_groups` are `self.inner`'s. The base class's `__init__` runs
    over a placeholder parameter before `inner` is set: until then its groups go to a placeholder
    list that is discarded."""

    inner: torch.optim.Optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        if "inner" not in self.__dict__:  # inside the base class's __init__
            return self.__dict__.setdefault("_placeholder_groups", [])
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if "inner" in self.__dict__:
            self.inner.param_groups = value
