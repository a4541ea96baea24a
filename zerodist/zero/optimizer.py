"""The ZeRO optimizer step: agree on overflow, clip by the global norm, step the shards, gather.

    reduced gradients (per bucket) -> overflow? (fp16; all ranks agree) -> global norm
    (partial sums of squares of disjoint shards, all-reduced) -> scale by 1/loss_scale and the
    clip coefficient -> torch optimizer steps this rank's tensors -> master -> params ->
    all-gather updated shards (stages 1/2)

The inner optimizer is a plain `torch.optim.Optimizer` over `FlatParamGroup.optimizer_tensors`;
it must be elementwise (the tensors are flattened shards), which the engine checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.precision import LossScaler
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.reducer import GradReducer

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclasses.dataclass(frozen=True)
class StepResult:
    grad_norm: float  # unscaled, before clipping; inf/nan on overflow
    overflow: bool
    clip_coef: float


class ZeroOptimizer:
    """Wraps the torch optimizer that steps this rank's shards. `param_groups` is the inner
    optimizer's, so learning-rate schedulers work on it as on any optimizer."""

    def __init__(self, groups: list[FlatParamGroup], reducer: GradReducer, inner: torch.optim.Optimizer, *,
                 scaler: LossScaler, gradient_clipping: float, check_overflow: bool, norm_group: Any):
        self.groups, self.reducer, self.inner, self.scaler = groups, reducer, inner, scaler
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.norm_group = norm_group

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def _owned_grads(self) -> list[torch.Tensor]:
        return [g for group in self.groups for g in group.owned_grads()]

    def _any_overflow(self) -> bool:
        flag = torch.zeros(1, device=self.groups[0].device)
        for grad in self._owned_grads():
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)  # every rank skips together
        return bool(flag.item())

    def global_grad_norm(self) -> float:
        """L2 norm of the whole (scaled) gradient: each rank's shards are disjoint, so the sum of
        their squares over the group is the square of the norm."""
        squares = torch.zeros((), dtype=torch.float32, device=self.groups[0].device)
        for grad in self._owned_grads():
            squares += grad.float().pow(2).sum()
        comm.all_reduce(squares, group=self.norm_group)
        return math.sqrt(squares.item())

    def step(self) -> StepResult:
        if self.check_overflow and self._any_overflow():
            self.scaler.update(True)
            self.zero_grad()
            return StepResult(math.inf, True, 1.0)
        norm = self.global_grad_norm() / self.scaler.scale
        clip_coef = 1.0
        if self.gradient_clipping > 0:
            clip_coef = min(1.0, self.gradient_clipping / (norm + _CLIP_EPS))
        factor = clip_coef / self.scaler.scale
        for group in self.groups:
            for index, tensor in enumerate(group.optimizer_tensors):
                grad = group.reduced_grad(index)
                if tensor.dtype != grad.dtype:
                    grad = grad.to(tensor.dtype)
                if factor != 1.0:
                    grad.mul_(factor)
                tensor.grad = grad
        self.inner.step()
        for group in self.groups:
            group.copy_master_to_params()
            group.gather_params()
        self.zero_grad()
        self.scaler.update(False)
        return StepResult(norm, False, clip_coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every accumulated gradient (the next accumulation starts from zero)."""
        self.reducer.clear_gradients()
        for group in self.groups:
            for tensor in group.optimizer_tensors:
                tensor.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (scalar step counters excluded) plus master copies."""
        total = sum(g.state_bytes()["master"] for g in self.groups)
        for state in self.inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.scaler.load_state_dict(state["loss_scaler"])
