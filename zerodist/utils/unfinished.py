"""A module's output that the module has not finished computing yet.

[Note: unfinished outputs] Domino's inter-layer overlap (zerodist/tensor_parallel/domino.py)
returns from block n while its chunks are parked at block n's last row-parallel reduction: each
chunk finishes block n (the reduced sum, then whatever the block computes after it: a post-norm,
an MoE block's experts) under block n+1's call. So "the module's forward hook ran" is not "the
module is done" for such an output. A hook that acts when a module is done (ZeRO-3 frees the
block's gathered parameters there and arms its backward gather on the outputs: zerodist/zero/
schedule.py) asks: an `UnfinishedOutput` calls it back, with the module's real outputs, once the
last chunk has left the module. The two packages share a layer and do not import each other, so
the handshake lives here, below both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UnfinishedOutput:
    """An output whose module still runs: `when_finished(callback)` calls `callback(outputs)` (the
    tensors the module finally produced, a list) once it has finished, in the thread that drives
    the model's forward (at once when it already has). A forward abandoned before that never calls
    it."""

    def when_finished(self, callback: Callable[[list[Any]], None]) -> None:
        raise NotImplementedError
