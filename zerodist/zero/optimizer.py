"""The ZeRO optimizer step: agree on overflow, clip by the global norm, step the shards, gather.

    reduced gradients (per bucket) -> one all-reduce over the world: the global norm (partial
    sums of squares of disjoint shards), overflow (fp16; all ranks agree) and step checks ->
    scale by 1/loss_scale and the clip coefficient -> torch optimizer steps this rank's tensors
    -> master -> params. What gathers the updated shards is not the optimizer's business: the
    schedule's step hooks do (`register_step_pre_hook` / `register_step_post_hook`, as torch's
    optimizers have), [Note: overlapped parameter gather] in runtime.py.

[Note: the global norm over domains] Each parameter's squares must be summed exactly once.
Within a domain group the owned shards are disjoint, so summing them over the group's ranks
counts each element once; but the domain's groups are repeated over the axes the domain does
not reduce over: a dense group's over none (one group is the whole batch), an expert group's
over `expert` (each holds a *different* expert: all count), a LayerNorm weight's over `tensor`
(every tensor rank holds the same: only tensor index 0 counts). `DomainGroup.counts_in_norm`
says which; then one all-reduce over the world sums every domain at once. Within a group that
counts, a parameter whose placement says `in_norm=False` (a tied layer's copy on a later pipeline
stage: [Note: copies counted elsewhere] in zerodist/comm/domains.py) is left out
(`FlatParamGroup.norm_grads`): the rank holding the copy that counts adds it.

The inner optimizer is a plain `torch.optim.Optimizer` over `FlatParamGroup.optimizer_tensors`;
it must be elementwise (the tensors are flattened shards), which the engine checks.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.precision import LossScaler
from zerodist.zero import canonical
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.reducer import GradReducer

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclasses.dataclass(frozen=True)
class StepResult:
    grad_norm: float  # unscaled, before clipping; inf/nan on overflow
    overflow: bool  # the step was skipped on every rank (fp16 overflow, or non-finite gradients)
    clip_coef: float
    nonfinite: bool = False  # skipped for non-finite gradients without loss scaling (fp32/bf16)
    nonfinite_here: bool = False  # this rank's own reduced gradient shards held the non-finite values


class ZeroOptimizer:
    """Wraps the torch optimizer that steps this rank's shards. `param_groups` is the inner
    optimizer's, so learning-rate schedulers work on it as on any optimizer."""

    def __init__(self, groups: list[FlatParamGroup], reducer: GradReducer, inner: torch.optim.Optimizer, *,
                 scaler: LossScaler, gradient_clipping: float, check_overflow: bool, world_group: Group = None,
                 step_checks: list[Any] | None = None):
        self.groups, self.reducer, self.inner, self.scaler = groups, reducer, inner, scaler
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.world_group = world_group  # every rank of the job (None: the default group)
        # Small integers every rank must agree on, compared inside the step's one all-reduce:
        # objects with digests() -> list[int] (each < 2**20), explain() (raises) and reset().
        # Stage 3's run-order check is one ([Note: unit order check]).
        self.step_checks: list[Any] = list(step_checks or [])
        self.exact_norm = False  # the layout-invariant mode: [Note: the exact norm] in canonical.py
        # Called before the shards are stepped and after they were (not on a skipped step).
        # OrderedDicts, not dicts: RemovableHandle holds them weakly, and a plain dict cannot be.
        self._step_pre_hooks: collections.OrderedDict[int, Callable[[ZeroOptimizer], None]] = collections.OrderedDict()
        self._step_post_hooks: collections.OrderedDict[int, Callable[[ZeroOptimizer], None]] = collections.OrderedDict()

    def register_step_pre_hook(self, hook: Callable[[ZeroOptimizer], None]) -> RemovableHandle:
        """`hook(optimizer)` runs at the start of every `step()`, as torch.optim.Optimizer's."""
        handle = RemovableHandle(self._step_pre_hooks)
        self._step_pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable[[ZeroOptimizer], None]) -> RemovableHandle:
        """`hook(optimizer)` runs after every `step()` that changed the shards (not a skipped one)."""
        handle = RemovableHandle(self._step_post_hooks)
        self._step_post_hooks[handle.id] = hook
        return handle

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def _reduce_step_stats(self) -> tuple[float, bool]:
        """One all-reduce over the world for what every rank must agree on before stepping: the sum
        of squares of the owned gradients that count ([Note: the global norm over domains]), i.e.
        the squared global norm; whether any rank's gradients overflowed (fp16); and the step
        checks' digests, each sent with its square (the sums equal n*d and n*d**2 on every rank
        only if every rank's d is the same)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.groups[0].device)
        overflow = False
        for group in self.groups:
            grads = group.owned_grads()
            if group.domain_group.counts_in_norm and not self.exact_norm:
                for grad in group.norm_grads():
                    squares += grad.float().pow(2).sum()
            if self.check_overflow and not overflow:
                overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        digests = [float(d) for check in self.step_checks for d in check.digests()]
        stats = torch.tensor([0.0, float(overflow)] + [x for d in digests for x in (d, d * d)],
                             dtype=torch.float64, device=squares.device)
        stats[0] = squares
        if self.exact_norm:  # every rank holds the exact sum: rank 0 adds it, the others add +0.0
            exact = canonical.exact_squares([g for group in self.groups if group.domain_group.counts_in_norm
                                             for g in group.norm_grads()], self.world_group, squares.device)
            stats[0] = exact if comm.get_rank(self.world_group) == 0 else 0.0
        comm.all_reduce(stats, group=self.world_group)
        values = stats.tolist()
        n = comm.get_world_size(self.world_group)
        position = 2
        for check in self.step_checks:
            mine = check.digests()
            sums = values[position: position + 2 * len(mine)]
            position += 2 * len(mine)
            if any(sums[2 * i] != n * d or sums[2 * i + 1] != n * d * d for i, d in enumerate(mine)):
                check.explain()
            check.reset()
        return values[0], values[1] > 0

    def step(self) -> StepResult:
        for hook in list(self._step_pre_hooks.values()):
            hook(self)  # the schedule: finish the last gathers, reduce deferred gradients, free units
        self.reducer.settle_gradients()
        squares, overflow = self._reduce_step_stats()
        if overflow:
            self.scaler.update(True)
            self.zero_grad()
            return StepResult(math.inf, True, 1.0)
        if not math.isfinite(squares):
            # Without loss scaling nothing else looks: one rank's NaN, summed into every rank's
            # gradients and the clip's norm, would make every weight NaN. The sum of squares is the
            # same on every rank (all-reduced), so every rank skips together.
            local = not self.owned_grads_finite()
            self.zero_grad()
            return StepResult(squares, True, 1.0, nonfinite=True, nonfinite_here=local)
        norm = math.sqrt(squares) / self.scaler.scale
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
        self.zero_grad()
        self.scaler.update(False)
        for hook in list(self._step_post_hooks.values()):
            hook(self)  # the schedule: gather the updated parameters
        return StepResult(norm, False, clip_coef)

    def owned_grads_finite(self) -> bool:
        """Whether this rank's reduced gradient shards are all finite (before `step()` drops them)."""
        return all(bool(torch.isfinite(g).all()) for group in self.groups for g in group.owned_grads())

    def ranks_where(self, *flags: bool) -> list[list[int]]:
        """For each of this rank's `flags`, the ranks where it is true (one all-reduce over the
        world: for rare paths only)."""
        table = torch.zeros(len(flags), comm.get_world_size(self.world_group), dtype=torch.float32,
                            device=self.groups[0].device)
        table[:, comm.get_rank(self.world_group)] = torch.tensor([float(f) for f in flags], device=table.device)
        comm.all_reduce(table, group=self.world_group)
        return [[r for r, v in enumerate(row) if v] for row in table.tolist()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every accumulated gradient (the next accumulation starts from zero)."""
        self.reducer.clear_gradients()
        for group in self.groups:
            for tensor in group.optimizer_tensors:
                tensor.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors in memory (scalar step counters excluded) plus master copies.
        An inner optimizer that keeps its state elsewhere (zerodist.offload's swap files) says what it
        holds in memory itself, `resident_state_bytes()`: its `state` reads the files."""
        total = sum(g.state_bytes()["master"] for g in self.groups)
        resident = getattr(self.inner, "resident_state_bytes", None)
        if resident is not None:
            return total + int(resident())
        for state in self.inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def swapped_state_bytes(self) -> int:
        """Bytes of optimizer state in swap files, on disk (0 without offload to nvme)."""
        swapped = getattr(self.inner, "swapped_state_bytes", None)
        return 0 if swapped is None else int(swapped())

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.scaler.load_state_dict(state["loss_scaler"])
