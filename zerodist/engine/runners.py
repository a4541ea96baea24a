"""Batch runners: what `Engine.train_batch()` runs. One engine, one `train_batch`, a runner per kind of model.

    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches, one optimizer step

A runner runs one batch's forwards and backwards and hands the engine the micro-batches' losses;
the engine then steps (`Engine.apply_batch`). `AccumulationRunner` is the plain loop (forward,
backward, step per micro-batch through the engine's public calls); the pipeline's runner
(zerodist/engine/pipeline.py) runs the schedule executor instead and refuses the plain calls,
as DeepSpeed's `PipelineEngine` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

import zerodist.comm as comm
from zerodist.config import BatchSizes
from zerodist.debug import reduce_loss
from zerodist.zero import canonical

__all__ = ["AccumulationRunner", "BatchRunner", "data_iterator"]


class Engine(Protocol):
    """What the plain loop uses of `zerodist.engine.engine.Engine` (described, not imported: the
    engine imports this module)."""

    training_dataloader: Any
    own_data_iter: Iterator[Any] | None
    batch: BatchSizes
    module: torch.nn.Module
    topology: comm.Topology
    zero_state: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def deepspeed_order_iterator(self) -> Iterator[Any]: ...


class BatchRunner(Protocol):
    """Runs one batch on an engine."""

    # True: the engine's forward / backward / step are refused (pipeline mode: only train_batch)
    only_train_batch: bool

    def train_batch(self, engine: Any, data_iter: Iterator[Any] | None) -> torch.Tensor:
        """Forwards and backwards of one batch, then `engine.apply_batch(...)` (the `Engine`'s); the
        batch's mean loss."""
        ...

    def eval_batch(self, engine: Any, data_iter: Iterator[Any] | None, *, return_logits: bool,
                   compute_loss: bool, num_micro_batches: int | None) -> Any:
        """Forwards only; the mean loss (and the outputs with `return_logits`)."""
        ...


def data_iterator(engine: Engine, data_iter: Iterator[Any] | None, what: str) -> Iterator[Any]:
    """`data_iter`, else (DeepSpeed's way) the loader of `initialize(training_data=...)`, repeated."""
    if data_iter is not None:
        return data_iter
    if engine.own_data_iter is not None:  # made at an earlier call, or given by set_dataiterator()
        return engine.own_data_iter
    if engine.training_dataloader is None:
        raise ValueError(f"{what}: pass an iterator of micro-batches (or give initialize() training_data), e.g. "
                         "iter(zerodist.utils.RepeatingLoader(loader))")
    engine.own_data_iter = engine.deepspeed_order_iterator()
    return engine.own_data_iter


def _next(data_iter: Iterator[Any], index: int, count: int) -> Any:
    try:
        return next(data_iter)
    except StopIteration:
        raise ValueError(f"the data iterator ran out after {index} of {count} micro-batches; wrap the loader in "
                         "zerodist.utils.RepeatingLoader") from None


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", output)  # a Hugging Face model's output carries its loss
    if isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("train_batch(): the model's forward must return the scalar loss (or an output with a "
                         f".loss) for each micro-batch, got {type(output).__name__}")
    return loss


def _call(engine: Engine, batch: Any) -> Any:
    """A micro-batch as the model's arguments: a dict as keywords, a tuple or list as positions."""
    if isinstance(batch, dict):
        return engine(**batch)
    if isinstance(batch, (tuple, list)):
        return engine(*batch)
    return engine(batch)


class AccumulationRunner:
    """The plain accumulation loop: for each of `gradient_accumulation_steps` micro-batches,
    `engine(batch)` (a dict as keywords, a tuple as positions), `engine.backward(loss)`,
    `engine.step()`; the batch's mean loss over micro-batches and data-parallel ranks."""

    only_train_batch = False

    def train_batch(self, engine: Engine, data_iter: Iterator[Any] | None) -> torch.Tensor:
        source = data_iterator(engine, data_iter, "train_batch()")
        count = engine.batch.gradient_accumulation_steps
        losses = []
        for index in range(count):
            loss = _loss_of(_call(engine, _next(source, index, count)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return self._agreed(engine, losses)

    def eval_batch(self, engine: Engine, data_iter: Iterator[Any] | None, *, return_logits: bool,
                   compute_loss: bool, num_micro_batches: int | None) -> Any:
        source = data_iterator(engine, data_iter, "eval_batch()")
        count = num_micro_batches or engine.batch.gradient_accumulation_steps
        losses, outputs = [], []
        engine.module.eval()
        try:
            with torch.no_grad():
                for index in range(count):
                    output = _call(engine, _next(source, index, count))
                    outputs.append(output)
                    if compute_loss:
                        losses.append(_loss_of(output).detach().float())
        finally:
            engine.module.train()
        loss = self._agreed(engine, losses) if compute_loss else None
        return (loss, outputs) if return_logits else loss

    @staticmethod
    def _agreed(engine: Engine, losses: list[torch.Tensor]) -> torch.Tensor:
        topology = engine.topology
        zero = engine.zero_state
        if zero.optimizer.exact_norm and len(losses) == engine.batch.gradient_accumulation_steps:
            # the layout-invariant mode: the K losses by the canonical tree (zerodist/zero/canonical.py)
            return canonical.loss_mean(losses, topology.group(*topology.batch_axes),
                                       accumulation=len(losses), shard_gradients=zero.sharding.shard_gradients)
        return reduce_loss(torch.stack(losses).mean(), group=topology.group(*topology.batch_axes))
