"""Which parameters go in which optimizer group, and how to build the optimizer over shards.

The user gives one of: an optimizer instance (its class, constructor defaults and param
groups, e.g. a no-weight-decay group, are carried over), a callable `params -> optimizer`, or
nothing (then `config.optimizer` names it). The engine builds the real optimizer itself, over
the flat shards, and never steps or mutates the user's instance.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerodist.config import Config, ConfigError
from zerodist.config.params import argument_problems
from zerodist.utils import did_you_mean

# DeepSpeed's type names. "Adam" is decoupled (AdamW) unless params.adam_w_mode is false, as there.
_DEEPSPEED_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
_DEEPSPEED_ONLY = {"onebitadam", "onebitlamb", "zerooneadam", "lamb", "muadam", "muadamw", "musgd", "cpuadam",
                   "fusedadam", "lion"}
# Optimizers whose update is not elementwise: stepping flattened shards would change their math.
NOT_ELEMENTWISE = {"LBFGS", "SparseAdam", "Adafactor", "Muon"}


@dataclasses.dataclass
class ParamGroupSpec:
    """One optimizer param group: its parameters (model order) and hyper-parameters."""

    params: list[torch.nn.Parameter]
    options: dict[str, Any]


OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def _constructor_kwargs(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted}


def _check_elementwise(cls: type) -> None:
    if cls.__name__ in NOT_ELEMENTWISE:
        raise ValueError(
            f"optimizer {cls.__name__} is not elementwise: zerodist steps flattened parameter shards, "
            f"which would change its update. Use an elementwise optimizer (Adam, AdamW, SGD, Adagrad, ...)."
        )


def optimizer_from_config(config: Config) -> tuple[type, dict[str, Any]]:
    """The torch class and constructor arguments that `config.optimizer` names."""
    assert config.optimizer is not None
    name, params = config.optimizer.type, dict(config.optimizer.params)
    key = name.lower()
    if key in _DEEPSPEED_ONLY:
        raise ConfigError(f"optimizer.type {name!r} is a DeepSpeed-specific optimizer that zerodist does not "
                          "implement; use Adam, AdamW, SGD, Adagrad or any torch.optim class")
    if key in ("adam", "adamw"):
        if not params.pop("torch_adam", False):
            # DeepSpeed builds its own FusedAdam / DeepSpeedCPUAdam here, whose weight_decay defaults
            # to 0; torch's AdamW defaults to 0.01, so a config that names none would decay weights
            # under zerodist and not under DeepSpeed. (`torch_adam: true` is torch's class, default and all.)
            params.setdefault("weight_decay", 0.0)
        if key == "adam":
            name = "AdamW" if params.pop("adam_w_mode", True) else "Adam"
    name = _DEEPSPEED_NAMES.get(name.lower(), name)
    classes = {n: c for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)}
    lowered = {n.lower(): n for n in classes}
    if name not in classes and name.lower() not in lowered:
        raise ConfigError(f"optimizer.type {config.optimizer.type!r} is not a torch.optim optimizer"
                          + did_you_mean(name, classes))
    cls = classes.get(name) or classes[lowered[name.lower()]]
    accepted = inspect.signature(cls.__init__).parameters
    unknown = [k for k in params if k not in accepted]
    if unknown:
        raise ConfigError(f"optimizer.params {unknown} are not arguments of torch.optim.{cls.__name__}"
                          + did_you_mean(unknown[0], [a for a in accepted if a not in ("self", "params")]))
    problems = argument_problems("optimizer.params", cls, params)  # the types first: torch takes "lr": true
    if problems:
        raise ConfigError(problems)
    _check_values(cls, params)
    return cls, params


def _check_values(cls: type, params: dict[str, Any]) -> None:
    """torch checks the values (a negative lr, betas outside [0, 1)) only when the optimizer is
    built, on every rank, as a traceback: build one over a scalar now, so validation says it."""
    try:
        cls([torch.zeros(1, requires_grad=True)], **params)
    except ValueError as err:
        if str(err).startswith("Invalid"):  # torch's value checks; others (a device-only option) wait for the real build
            raise ConfigError(f"optimizer.params of torch.optim.{cls.__name__} {params}: {err}") from None
    except (TypeError, RuntimeError):
        pass


def steps_nothing(optimizer: Any, config: Config) -> bool:
    """Whether `initialize()` builds a `NoOptimizer`: no optimizer passed and no config section."""
    return optimizer is None and config.optimizer is None


def resolve_optimizer(
    model: torch.nn.Module, model_parameters: Iterable[Any] | None, optimizer: Any, config: Config
) -> tuple[list[ParamGroupSpec], OptimizerFactory]:
    """The param groups to flatten and a factory that builds the optimizer over their shards."""
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        _check_elementwise(cls)
        specs = [ParamGroupSpec(list(g["params"]), {k: v for k, v in g.items() if k != "params"})
                 for g in optimizer.param_groups]
        kwargs = _constructor_kwargs(cls, dict(optimizer.defaults))
        return specs, lambda groups: cls(groups, **kwargs)
    specs = _groups_from_parameters(model, model_parameters)
    if callable(optimizer):
        _check_something_to_train(model, specs, "the optimizer callable")
        def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            built = optimizer([{**g} for g in groups])
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
            _check_elementwise(type(built))
            return built
        return specs, build
    if optimizer is not None:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable params -> optimizer, "
                        f"got {type(optimizer).__name__}")
    if steps_nothing(optimizer, config):  # DeepSpeed's engine without an optimizer: forward and backward only
        return specs, lambda groups: NoOptimizer(groups)
    _check_something_to_train(model, specs, "the config's \"optimizer\" section")
    cls, kwargs = optimizer_from_config(config)
    _check_elementwise(cls)
    return specs, lambda groups: cls(groups, **kwargs)


class NoOptimizer(torch.optim.Optimizer):
    """What `initialize()` without an optimizer (none passed, no config section) builds, as DeepSpeed
    builds an engine without one: forward and backward run (a script that only wants the engine's
    groups, or evaluates); `step()` refuses on every rank, naming the fix. It holds no state, so
    loading a checkpoint skips the optimizer's (`holds_state`, read by zerodist/checkpoint/state.py)."""

    holds_state = False

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        # A model with nothing to train (a frozen reference or teacher model, as TRL's
        # create_reference_model leaves it) has no groups; torch refuses an optimizer over none, so
        # it stands over one placeholder tensor that nothing reads.
        super().__init__(groups or [{"params": [torch.zeros(0)]}], {"lr": 0.0})

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise ConfigError("no optimizer: this engine was built without one (initialize() got no optimizer= and the "
                          "config has no \"optimizer\" section), so it cannot step; add an \"optimizer\": "
                          "{\"type\": ..., \"params\": {...}} section to the config, or pass optimizer= to "
                          "initialize()")


def _check_something_to_train(model: torch.nn.Module, specs: list[ParamGroupSpec], asked_by: str) -> None:
    """An optimizer over no trainable parameter is refused by name (torch's own message names no cause)."""
    if not any(spec.params for spec in specs):
        total = sum(1 for _ in model.parameters())
        raise ConfigError(f"{asked_by} asks for an optimizer, but no parameter of the model requires grad "
                          f"({total} parameter(s), all frozen or given in no group): there is nothing to train. "
                          "For a model that only runs forward (a reference or teacher model), pass no optimizer and "
                          "leave the \"optimizer\" section out; to train, set requires_grad=True on what should learn")


def _groups_from_parameters(model: torch.nn.Module, model_parameters: Iterable[Any] | None) -> list[ParamGroupSpec]:
    if model_parameters is None:
        return [ParamGroupSpec([p for p in model.parameters() if p.requires_grad], {})]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [ParamGroupSpec(list(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in items]
    return [ParamGroupSpec([p for p in items if p.requires_grad], {})]


def check_groups_cover_model(model: torch.nn.Module, specs: list[ParamGroupSpec]) -> dict[int, str]:
    """Names of grouped parameters by id; every trainable parameter must be in exactly one group."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, int] = {}
    for index, spec in enumerate(specs):
        for p in spec.params:
            if id(p) not in names:
                raise ValueError("an optimizer param group holds a tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]!r} is in optimizer param groups {seen[id(p)]} and {index}")
            seen[id(p)] = index
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"parameters {missing} require grad but are in no optimizer param group; add them to a "
                         "group or set requires_grad=False")
    return names
