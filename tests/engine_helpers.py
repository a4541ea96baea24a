"""Shared pieces of the engine tests: a reference trainer and a distributed trainer on the
same global batches, so every distributed result can be compared with one process."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterator

import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.models import make_mlp

IN_DIM, OUT_DIM = 16, 8


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, IN_DIM, generator=g), torch.randn(rows, OUT_DIM, generator=g)


def base_config(stage: int, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def train_distributed(config: dict[str, Any], steps: int, *, model: torch.nn.Module | None = None,
                      optimizer: Any = None, **init_kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Train on this rank's slices of each global batch; returns (engine, final state dict)."""
    model = model if model is not None else make_mlp()
    engine, _, _, _ = zerodist.initialize(model=model, optimizer=optimizer, config=config, **init_kwargs)
    n, rank = comm.get_world_size(), comm.get_rank()
    micro, gas = engine.batch.micro_batch_size, engine.batch.gradient_accumulation_steps
    for step in range(steps):
        x, y = global_batch(step, micro * gas * n)
        for m in range(gas):
            rows = slice((m * n + rank) * micro, (m * n + rank + 1) * micro)
            loss = F.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
    return engine, engine.module_state_dict()


def train_reference(steps: int, *, rows: int, lr: float = 1e-2, weight_decay: float = 0.01, clip: float = 0.0,
                    model: torch.nn.Module | None = None, optimizer: Any = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch each step; returns final state and grad norms."""
    model = model if model is not None else make_mlp()
    opt = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    norms = []
    for step in range(steps):
        x, y = global_batch(step, rows)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def assert_close_relative(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        a, e = actual[key].double(), expected[key].double()
        err = ((a - e).norm() / e.norm().clamp_min(1e-12)).item()
        assert err <= tol, f"{key}: relative error {err:.3e} > {tol:.0e}"


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


@contextlib.contextmanager
def zerodist_log() -> Iterator[list[str]]:
    """The zerodist logger's messages (it does not propagate to the root logger, so caplog misses them)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    logging.getLogger("zerodist").addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger("zerodist").removeHandler(handler)
