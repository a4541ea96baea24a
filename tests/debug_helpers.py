"""Shared pieces of the debug-toolkit tests: a tiny GPT engine, per-rank batches, captured logs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import GPT, gpt_config


def gpt_engine(stage: int, **overrides: Any) -> Any:
    """The tiny GPT under ZeRO `stage`, identical weights on every rank."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000},
        "steps_per_print": 10**9,
        **overrides,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny"))
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    return engine


def rank_batch(step: int, rows: int = 2, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens for `step`: different on every rank, as data-parallel batches are."""
    g = torch.Generator().manual_seed(100 * step + comm.get_rank())
    tokens = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(engine: Any, step: int, *, optimizer_step: bool = True) -> torch.Tensor:
    inputs, targets = rank_batch(step, engine.batch.micro_batch_size)
    loss = engine(inputs, targets)
    engine.backward(loss)
    if optimizer_step:
        engine.step()
    return loss.detach()


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured_logs(name: str = "zerodist") -> Iterator[list[str]]:
    """The messages logged under `name` inside the block (the handler is removed after)."""
    handler = _ListHandler()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
