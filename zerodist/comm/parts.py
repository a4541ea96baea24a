"""Parts: the pieces of the model this rank holds, and the surface every technique's state shares.

`initialize()` splits the model into parts before it applies anything (validate -> topology ->
split -> per part: tensor parallel -> expert parallel -> ZeRO -> engine), because pipeline
parallelism gives each rank some layers only, and tensor, expert and ZeRO parallelism then
apply to those layers, not to the model. Without a pipeline there is one part, the whole model.

A technique's front door (`zerodist.zero.apply_zero`, ...) takes a `Part` and returns a part
state with one small surface (`PartState`), so the engine loops over parts without knowing how
each technique keeps its state. Parts live here, beside the topology whose `pipe` axis decides
them, so that every layer-5 package can take one without importing another.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from zerodist.comm.domains import logical_names


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of the model held by this rank: `module`, the `index`-th of `num_parts`."""

    index: int
    module: torch.nn.Module
    num_parts: int = 1

    @property
    def names(self) -> dict[int, str]:
        """Parameter id -> its logical name (the model's without parallelism), which checkpoints key
        by ([Note: logical names] in domains.py)."""
        return logical_names(self.module)


class PartState(Protocol):
    """What every technique's state of one part offers the engine. A technique that changes names
    or shapes (tensor slices, local expert ids) maps between its view and the logical one; ZeRO
    changes neither (its sharding is invisible in a `state_dict()` taken while gathered)."""

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part's `state_dict()` as this technique holds it -> the names and shapes of the model
        without parallelism (collective)."""
        ...

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse: what this rank holds of a logical state dict (no collective)."""
        ...

    def report(self) -> list[str]:
        """Lines that describe what the technique did to the part, for the start-up summary."""
        ...

    def remove_hooks(self) -> None:
        """Take every hook the technique registered off the part's modules and tensors."""
        ...


def split_parts(model: torch.nn.Module, pipe_degree: int = 1, pipe_rank: int = 0) -> list[Part]:
    """The parts this rank holds: one. Without a pipeline it is the whole model; a pipeline's model
    (`zerodist.pipe.PipelineModule`) arrives already split, each rank having built only the layers of
    its own stages (several stages per rank still make one part: one flat layout, one optimizer)."""
    if not 0 <= pipe_rank < pipe_degree:
        raise ValueError(f"pipe rank {pipe_rank} is outside the pipe degree {pipe_degree}")
    return [Part(pipe_rank, model, pipe_degree)]
