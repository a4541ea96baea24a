"""What every composition test checks against one process: each step's state of every rank's
parameters within 1e-6 of the reference's, and together they cover every reference parameter."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def assert_states_match(runs: Iterable[list[dict[str, torch.Tensor]]], reference: list[dict[str, torch.Tensor]],
                        label: Any) -> None:
    """`runs`: each rank's per-step state dicts (its own parameters); `reference`: one process's."""
    keys: set[str] = set()
    for states in runs:
        for step, state in enumerate(states):
            keys |= set(state)
            for key, value in state.items():
                assert value.shape == reference[step][key].shape, key
                assert torch.allclose(value, reference[step][key], rtol=0, atol=1e-6), (label, step, key)
    assert keys == set(reference[0])
