"""DeepSpeed's learning-rate schedules (`scheduler.type` in the config), same formulas.

Each schedule sets absolute learning rates on the optimizer's param groups at every
`step()`; `state_dict()` holds the iteration so a resumed run continues the schedule.
Any `torch.optim.lr_scheduler` class may also be named in the config.

[Note: schedule iterations] As in DeepSpeed, a schedule is built at iteration -1 and sets the
"not started" rate (the warmup minimum; 0 for WarmupCosineLR), which the first optimizer step
uses; each `step()` then moves to the next iteration, so step n+1 uses iteration n-1's rate
(a log or linear warmup therefore uses its minimum for two steps). The same iteration numbers
make a DeepSpeed run and a zerodist run step with the same rates, and let a checkpoint's
`last_batch_iteration` mean the same thing in both.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from zerodist.config import Config, ConfigError
from zerodist.config.params import argument_problems
from zerodist.utils import did_you_mean


def _warmup_gamma(iteration: int, num_steps: int, kind: str) -> float:
    """Warmup progress in [0, 1] at `iteration` >= 0; `num_steps` >= 2 (DeepSpeed's floor)."""
    if iteration >= num_steps:
        return 1.0
    if kind == "log":
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


class Schedule:
    """Base: subclasses give `lrs(iteration)`, and may give `momentum(iteration)`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []
        self.step(last_batch_iteration)  # iteration -1: the "not started" rate ([Note: schedule iterations])

    def lrs(self, iteration: int) -> list[float]:
        """The rates at `iteration` (-1: before the first step)."""
        raise NotImplementedError

    def momentum(self, iteration: int) -> float | None:
        return None

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._last_lr = self.lrs(self.last_batch_iteration)
        mom = self.momentum(self.last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
            if mom is not None:
                if "betas" in group:
                    group["betas"] = (mom, group["betas"][1])
                elif "momentum" in group:
                    group["momentum"] = mom

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs = list(state["base_lrs"])
        self.step(state["last_batch_iteration"])


class WarmupLR(Schedule):
    def __init__(self, optimizer: Any, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_num_steps, self.warmup_type = max(2, warmup_num_steps), warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)

    def lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [self.min_lr for _ in self.optimizer.param_groups]
        lr = self.min_lr + (self.max_lr - self.min_lr) * self.gamma(iteration)
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if total_num_steps < warmup_num_steps:
            raise ConfigError(f"WarmupDecayLR: total_num_steps ({total_num_steps}) < warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps, self.warmup_min_ratio = total_num_steps, warmup_min_ratio
        self.warmup_num_steps, self.cos_min_ratio, self.warmup_type = max(2, warmup_num_steps), cos_min_ratio, warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lrs(self, iteration: int) -> list[float]:
        return [base * self.ratio(iteration) for base in self.base_lrs]


class OneCycle(Schedule):
    """One triangular cycle from `cycle_min_lr` up to `cycle_max_lr` and back, then decay.
    Momentum (beta1 or SGD momentum) cycles the opposite way when `cycle_momentum`."""

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        if cycle_first_stair_count or cycle_second_stair_count:
            raise ConfigError("OneCycle stair counts are not implemented by zerodist; remove them")
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.total_size = cycle_first_step_size + second
        self.step_ratio = cycle_first_step_size / self.total_size
        self.decay_step_size, self.cycle_momentum = decay_step_size, cycle_momentum
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        # DeepSpeed's position in the cycle counts the batch about to run: iteration + 1.
        position = (iteration + 1) / self.total_size
        x = 1.0 + position - math.floor(1.0 + position)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size if self.decay_step_size else 0.0

    def lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [self.min_lr for _ in self.optimizer.param_groups]
        if iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale(iteration)
        else:
            lr = self.min_lr / (1.0 + self.decay_lr_rate * self._decay_interval(iteration))
        return [lr for _ in self.optimizer.param_groups]

    def momentum(self, iteration: int) -> float | None:
        if not self.cycle_momentum:
            return None
        if iteration < 0:
            return self.min_mom
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        return self.max_mom * (1.0 + self.decay_mom_rate * self._decay_interval(iteration))


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def build_scheduler(config: Config, optimizer: torch.optim.Optimizer, user_scheduler: Any) -> Any:
    """The user's scheduler (instance re-targeted at the sharded optimizer, or a callable
    `optimizer -> scheduler`), else the one `config.scheduler` names, else None."""
    if user_scheduler is not None:
        if callable(user_scheduler) and not hasattr(user_scheduler, "step"):
            return user_scheduler(optimizer)
        # A scheduler built on the user's own optimizer: point it at the one that steps.
        for group, lr in zip(optimizer.param_groups, getattr(user_scheduler, "base_lrs", [])):
            group.setdefault("initial_lr", lr)
        user_scheduler.optimizer = optimizer
        return user_scheduler
    if config.scheduler is None:
        return None
    cls, params = scheduler_from_config(config)
    try:
        return cls(optimizer, **params)
    except TypeError as err:
        raise ConfigError(f"scheduler {config.scheduler.type}: {err}") from None


def scheduler_from_config(config: Config) -> tuple[Any, dict[str, Any]]:
    """The schedule class `config.scheduler` names and its arguments, each checked to be one of
    the class's (with a did-you-mean): a typo is a validation error, not a traceback on every rank."""
    assert config.scheduler is not None
    name, params = config.scheduler.type, dict(config.scheduler.params)
    if name in SCHEDULES:
        cls: Any = SCHEDULES[name]
    elif isinstance(getattr(torch.optim.lr_scheduler, name, None), type):
        cls = getattr(torch.optim.lr_scheduler, name)
    else:
        raise ConfigError(f"scheduler.type {name!r} is neither a DeepSpeed schedule ({', '.join(SCHEDULES)}) nor a "
                          "torch.optim.lr_scheduler class" + did_you_mean(name, SCHEDULES))
    accepted = [a for a in inspect.signature(cls.__init__).parameters if a not in ("self", "optimizer")]
    unknown = [k for k in params if k not in accepted]
    if unknown and not any(inspect.signature(cls.__init__).parameters[a].kind == inspect.Parameter.VAR_KEYWORD
                           for a in accepted):
        raise ConfigError(f"scheduler.params {unknown} are not arguments of {name}" + did_you_mean(unknown[0], accepted))
    problems = argument_problems("scheduler.params", cls, params)
    if problems:
        raise ConfigError(problems)
    return cls, params
