"""Named random streams for dropout inside and outside tensor-parallel regions.

Dropout in a *replicated* region (after a row-parallel reduction, without sequence parallelism)
must draw the same mask on every tensor rank, or the replicas silently diverge; dropout in a
*sharded* region (attention probabilities of this rank's heads, or sequence shards) must draw
different masks on different tensor ranks, or the shards are correlated. `RNGTracker` keeps one
saved generator state per stream and `fork(name)` swaps it into torch's default generators (the
CPU one and, when CUDA is initialised, the current device's) for the duration of a block, so
`nn.Dropout` and `F.scaled_dot_product_attention` need no change. Device-agnostic: it only uses
`torch.Generator.get_state / set_state`. The streams are saved in checkpoints (`state_dict`).

Seeds (Megatron's convention): `replicated` = seed (equal across tensor ranks), `sharded` =
seed + 2718 + tensor rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from zerodist.comm.topology import Topology

SHARDED_SEED_OFFSET = 2718


def _default_generators() -> list[torch.Generator]:
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return generators


def _seeded_states(seed: int) -> list[torch.Tensor]:
    states = []
    for generator in _default_generators():
        fresh = torch.Generator(device=generator.device)
        fresh.manual_seed(seed)
        states.append(fresh.get_state())
    return states


class RNGTracker:
    """Named generator states; `fork(name)` runs a block on that stream (see the module docstring)."""

    def __init__(self) -> None:
        self._states: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._states[name] = _seeded_states(seed)

    @property
    def names(self) -> list[str]:
        return list(self._states)

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"no RNG stream {name!r}; the streams are {self.names}")
        generators = _default_generators()
        saved = [g.get_state() for g in generators]
        for generator, state in zip(generators, self._states[name]):
            generator.set_state(state)
        try:
            yield
        finally:
            self._states[name] = [g.get_state() for g in generators]
            for generator, state in zip(generators, saved):
                generator.set_state(state)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {name: [s.clone() for s in states] for name, states in self._states.items()}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        self._states = {name: [s.clone() for s in states] for name, states in state.items()}


def tensor_parallel_rng(topology: Topology, seed: int) -> RNGTracker:
    """The `replicated` and `sharded` streams of this rank (see the module docstring)."""
    tracker = RNGTracker()
    tracker.add("replicated", seed)
    tracker.add("sharded", seed + SHARDED_SEED_OFFSET + topology.axis_rank("tensor"))
    return tracker


# The tracker that a model's tensor-parallel layers draw from, kept beside the model (never on it)
# so that checkpoints can save and restore its streams.
_TRACKERS: weakref.WeakKeyDictionary[nn.Module, RNGTracker] = weakref.WeakKeyDictionary()


def attach_rng_tracker(model: nn.Module, tracker: RNGTracker) -> None:
    _TRACKERS[model] = tracker


def rng_tracker_of(model: nn.Module) -> RNGTracker | None:
    """The tracker `initialize` made for `model`'s tensor-parallel layers, if any."""
    return _TRACKERS.get(model)
