"""Stepped values held outside memory: the seam between ZeRO's flat groups and a store (zerodist.offload).

[Note: stepped values elsewhere] What the optimizer steps for a flat group (its `optimizer_tensors`:
views of the fp32 parameter shard at stage 3, or of the fp32 master under bf16/fp16) can live in a
`SteppedStore` instead of memory: zerodist.offload's swapped optimizer keeps them in its sub-group
swap files, one more region beside the optimizer state, and steps them there piece by piece. ZeRO
never knows which store it is; the engine wires one in after building the optimizer
(`offload_stepped_values` in apply.py). From then on:

    optimizer_tensors, master   a NaN broadcast to their shape (no memory, never a stale value;
                                writing in place raises torch's error), same objects, so the
                                optimizer, its param groups and a scheduler see nothing change
    the parameter shard         `shard=True` (offload_param): freed the same way; each gather reads
                                this rank's shard from the store straight into its place in the
                                unit's full (pooled, transient) buffer and all-gathers in place, so
                                in fp32 no other copy of it is made (under bf16 it is cast from the
                                fp32 master: no second copy on disk, but one bucket's fp32 values
                                in memory while it is read)
    mixed precision             the store tells the group each stepped piece's new master values
                                (`cast_stepped`): they are cast into the bf16 shard or buffer, what
                                `copy_master_to_params` does for the whole shard in memory
    everything else             reads and writes through the group: `stepped_values(i)` (the
                                checkpoint writer), `write_stepped(i, values)` (checkpoint and
                                pretrained loads), `take_shard_from_full` (GatheredParameters with a
                                modifier rank), `state_bytes` (counts nothing held elsewhere)

A read that fails before a gather fails on one rank only; the runtime reads every shard of a
batch of units first, then lets the store agree over the group (one small all-reduce), so every
rank raises the same named error instead of the others hanging in the all-gather.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch


class SteppedStore(Protocol):
    """Where held values live ([Note: stepped values elsewhere]); zerodist.offload's swapped optimizer is one."""

    def hold_values(self, tensors: Mapping[torch.Tensor, Callable[[int, torch.Tensor], None] | None]) -> None:
        """Take `tensors`' current values; `notify(start, values)` is told each stepped piece's new values."""

    def read_values(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of a held tensor, into `out`."""

    def write_values(self, tensor: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Overwrite elements [start, start + values.numel()) of a held tensor."""

    def agree(self, failure: Exception | None) -> None:
        """Raise on every rank of the group when `failure` happened on any (collective)."""
