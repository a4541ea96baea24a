"""What checkpoint/ uses of an engine, as a Protocol: checkpoint/ sits below engine/ and never
imports it. It reads the typed ZeRO state, never engine internals; `zerodist.Engine` satisfies
`HasZeroState` structurally."""

from __future__ import annotations

from typing import Protocol

from zerodist.zero.state import ZeroState


class HasZeroState(Protocol):
    @property
    def zero_state(self) -> ZeroState: ...
