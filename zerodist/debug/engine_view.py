"""What debug/ uses of an engine, as a Protocol: debug/ sits below engine/ and never imports it.

`zerodist.Engine` satisfies `TrainingEngine` structurally; so does any object with the same
surface (a test double, a future engine over several parts)."""

from __future__ import annotations

from typing import Protocol

import torch

from zerodist.config import Config
from zerodist.zero.state import ZeroState, zero_state_of


class TrainingEngine(Protocol):
    """The engine calls and state that the debug tools read: its ZeRO state (never engine
    internals), the step counter, the config, and the training calls they wrap."""

    @property
    def zero_state(self) -> ZeroState: ...

    @property
    def global_steps(self) -> int: ...

    @property
    def config(self) -> Config: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def is_gradient_accumulation_boundary(self) -> bool: ...


def state_of(engine: TrainingEngine | ZeroState) -> ZeroState:
    """`engine`'s ZeRO state, or a TypeError naming what was passed instead of an engine."""
    state = zero_state_of(engine)
    if state is None:
        raise TypeError(f"expected a zerodist engine, got {type(engine).__name__}")
    return state
