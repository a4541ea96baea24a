"""Parts: the pieces of the model this rank holds, and the surface every technique's state shares.

`initialize()` splits the model into parts before it applies anything (validate -> topology ->
split -> per part: tensor parallel -> sequence parallel -> expert parallel -> ZeRO -> engine),
because pipeline parallelism gives each rank some layers only (`zerodist.pipe.apply_pipeline`),
and tensor, expert and ZeRO parallelism then apply to those layers, not to the model. Without a
pipeline there is one part, the whole model.

A technique's front door (`zerodist.zero.apply_zero`, ...) takes a `Part` and returns a part
state with one small surface (`PartState`), so the engine loops over parts without knowing how
each technique keeps its state. The engine keeps the states by name in a `PartStates`, with the
`PartRoles` each plays for it (loader, random streams, resume, step log, close). Parts live here, beside the topology whose `pipe` axis decides
them, so that every layer-5 package can take one without importing another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

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
    its own stages (several stages per rank still make one part: one flat layout, one optimizer;
    `zerodist.pipe.apply_pipeline` calls this with the pipe axis' degree and this rank's place)."""
    if not 0 <= pipe_rank < pipe_degree:
        raise ValueError(f"pipe rank {pipe_rank} is outside the pipe degree {pipe_degree}")
    return [Part(pipe_rank, model, pipe_degree)]


@dataclasses.dataclass(frozen=True)
class PartRoles:
    """What a technique's state does for the engine beyond the `PartState` surface, each optional:
    the engine calls them through `PartStates`, never the technique's functions by hand.

    wrap_loader(loader) -> loader   how this rank reads its batches (a sequence rank: its slice)
    rng_key, rng_state(), load_rng_state(state)   random streams of the technique's own, saved
                                    in a checkpoint's training state under `rng_key`
    resume(micro_steps)             after a load: continue at micro-step `micro_steps`
    step_lines() -> lines           what the step log prints (MoE routing on rank 0)
    close()                         release what lives outside the model (swap files)
    """

    wrap_loader: Callable[[Any], Any] | None = None
    rng_key: str | None = None
    rng_state: Callable[[], Any] | None = None
    load_rng_state: Callable[[Any], None] | None = None
    resume: Callable[[int], None] | None = None
    step_lines: Callable[[], list[str]] | None = None
    close: Callable[[], None] | None = None


class PartStates:
    """The technique states of this rank's part, by name, in the order applied (pipe, tensor,
    sequence, expert, zero), with their roles. The engine loops over it for the logical state dict,
    the start-up report, the loader, random streams, hooks and close; it never unpacks positions.

        parts = PartStates()
        parts.add("tensor", tensor_state, PartRoles(rng_key="tensor_parallel", ...))
        parts["zero"]                     # the ZeroState
        parts.to_logical(state)           # every technique's mapping, in the order applied
    """

    def __init__(self) -> None:
        self._states: dict[str, PartState] = {}
        self._roles: dict[str, PartRoles] = {}

    def add(self, name: str, state: PartState, roles: PartRoles | None = None) -> None:
        if name in self._states:
            raise ValueError(f"part state {name!r} added twice")
        self._states[name], self._roles[name] = state, roles or PartRoles()

    def __getitem__(self, name: str) -> Any:
        return self._states[name]

    def get(self, name: str) -> Any:
        return self._states.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def items(self) -> list[tuple[str, PartState]]:
        return list(self._states.items())

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part's state dict in the logical model's names and shapes (collective)."""
        for part_state in self._states.values():
            state = part_state.to_logical(state)
        return state

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank holds of a logical state dict (no collective): the inverse, in reverse."""
        for part_state in reversed(self._states.values()):
            state = part_state.from_logical(state)
        return state

    def report(self) -> list[str]:
        return [line for part_state in self._states.values() for line in part_state.report()]

    def wrap_loader(self, loader: Any) -> Any:
        for roles in self._roles.values():
            if roles.wrap_loader is not None:
                loader = roles.wrap_loader(loader)
        return loader

    def rng_states(self) -> dict[str, Any]:
        """The techniques' own random streams, by `rng_key`."""
        return {roles.rng_key: roles.rng_state() for roles in self._roles.values()
                if roles.rng_key is not None and roles.rng_state is not None}

    def load_rng_states(self, states: dict[str, Any]) -> None:
        for roles in self._roles.values():
            if roles.rng_key is not None and roles.load_rng_state is not None and roles.rng_key in states:
                roles.load_rng_state(states[roles.rng_key])

    def resume(self, micro_steps: int) -> None:
        for roles in self._roles.values():
            if roles.resume is not None:
                roles.resume(micro_steps)

    def step_lines(self) -> list[str]:
        return [line for roles in self._roles.values() if roles.step_lines is not None for line in roles.step_lines()]

    def remove_hooks(self) -> None:
        """Every technique's hooks off, the last applied first."""
        for part_state in reversed(self._states.values()):
            part_state.remove_hooks()

    def close(self) -> None:
        for roles in reversed(self._roles.values()):
            if roles.close is not None:
                roles.close()
