"""The engine's own resumable state (`Engine.training_state_dict()` / `load_training_state_dict()`):
step counters, loss scaler, learning-rate scheduler, this process's RNG streams and the data
loader's position. The model and optimizer tensors are ZeRO's (`Engine.zero_state`); a
checkpoint stores both.

The keys, all of them in a saved dict: `global_steps`, `micro_steps`, `skipped_steps`,
`gradient_accumulation_steps` (a load at another accumulation resumes at its own boundary of the
saved step), `loss_scaler`, `lr_scheduler` (None without a
scheduler), `rng` and `data` (None without a loader that has a position). On load the counters
are required; every other key may be absent (a checkpoint loaded at another world size has no
RNG stream or data position for this rank) or None.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zerodist.checkpoint.state import capture_rng, restore_rng
from zerodist.comm.parts import PartStates
from zerodist.config import BatchSizes
from zerodist.utils import get_logger, log_rank0
from zerodist.zero import ZeroOptimizer


class Engine(Protocol):
    """What the resumable training state reads and writes of an engine (engine.py's `Engine`;
    described, not imported, so that engine.py can import this module)."""

    module: torch.nn.Module
    global_steps: int
    micro_steps: int
    skipped_steps: int
    batch: BatchSizes
    optimizer: ZeroOptimizer
    lr_scheduler: Any
    training_dataloader: Any
    part_states: PartStates  # the techniques' random streams and resume, by name

logger = get_logger(__name__)
COUNTERS = ("global_steps", "micro_steps", "skipped_steps")


def training_state_dict(engine: Engine) -> dict[str, Any]:
    loader = engine.training_dataloader
    scheduler = engine.lr_scheduler
    return {
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "gradient_accumulation_steps": engine.batch.gradient_accumulation_steps,
        "loss_scaler": engine.optimizer.scaler.state_dict(),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": _capture_rng(engine),
        "data": loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None,
    }


def load_training_state_dict(engine: Engine, state: dict[str, Any]) -> None:
    missing = [key for key in COUNTERS if key not in state]
    if missing:
        raise KeyError(f"load_training_state_dict: the state has no {', '.join(missing)}; pass a dict made by "
                       "training_state_dict()")
    engine.global_steps, engine.micro_steps, engine.skipped_steps = (int(state[key]) for key in COUNTERS)
    accumulation = engine.batch.gradient_accumulation_steps
    if state.get("gradient_accumulation_steps") != accumulation:
        # Saved at another accumulation (another world size dealing the same global batch), or not
        # said: resume at this run's boundary of the saved step, not at the saved micro-step count.
        engine.micro_steps = engine.global_steps * accumulation
    engine.part_states.resume(engine.micro_steps)  # MoE random routing continues where it was
    if state.get("loss_scaler") is not None:
        engine.optimizer.scaler.load_state_dict(state["loss_scaler"])
    if state.get("lr_scheduler") is not None:
        if engine.lr_scheduler is None:
            log_rank0(logger, "the training state has learning-rate scheduler state but this engine has no "
                      "scheduler; ignored", level=30)
        else:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    loader = engine.training_dataloader
    if state.get("data") is not None and loader is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state["data"])
    if state.get("rng") is not None:
        restore_rng(state["rng"])
        engine.part_states.load_rng_states(state["rng"])  # tensor parallelism's dropout streams


def _capture_rng(engine: Engine) -> dict[str, Any]:
    """This process's streams, and tensor parallelism's dropout streams (replicated / sharded)."""
    rng = capture_rng()
    rng.update(engine.part_states.rng_states())  # under each technique's key ("tensor_parallel")
    return rng
