"""The small state beside the tensors: RNG streams, optimizer settings, scheduler.

[Note: param groups by name] A resharded load may see another number of optimizer param groups
(ZeRO-3 makes one per module unit and user group). Settings are therefore recorded per
parameter name: which saved param group the parameter was in, that group's options (lr,
betas, ...), and the non-elementwise state (Adam's `step`) of its bucket. Each new param group
takes the settings of its first parameter; per-group lists in the scheduler's state
(`base_lrs`, ...) are remapped the same way.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from zerodist.checkpoint.errors import CheckpointError
from zerodist.utils import get_logger, log_rank0


def capture_rng() -> dict[str, Any]:
    """This process's random streams: Python, torch (CPU, and CUDA when in use), numpy if present."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return state
    state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        numpy.random.set_state(state["numpy"])

logger = get_logger(__name__)


def _first_names(groups: list[Any], inner: torch.optim.Optimizer) -> list[str | None]:
    """The name of the first parameter of each inner param group (None: an empty group)."""
    name_of = {}
    for group in groups:
        for index, tensor in enumerate(group.optimizer_tensors):
            name_of[id(tensor)] = group.records[group.layout.buckets[index].param_indices[0]].name
    return [name_of[id(pg["params"][0])] if pg["params"] else None for pg in inner.param_groups]


def group_mapping(groups: list[Any], inner: torch.optim.Optimizer, saved: dict[str, Any]) -> list[int | None]:
    """For each param group now, the index of the saved param group its parameters came from. An
    empty group has no parameter to go by: the k-th empty group now is the k-th saved group that held
    no parameter, or None where there is none (a checkpoint from before empty groups were kept)."""
    held = set(saved["group_of"].values())
    empty = iter([k for k in range(len(saved["options"])) if k not in held])
    return [saved["group_of"][name] if name is not None else next(empty, None) for name in _first_names(groups, inner)]


def restore_optimizer(groups: list[Any], inner: torch.optim.Optimizer, saved: dict[str, Any],
                      elementwise: dict[int, dict[str, torch.Tensor]]) -> None:
    """Load options and state through the optimizer's own `load_state_dict` (which casts and
    places state as the optimizer expects) ([Note: param groups by name]). An engine built without
    an optimizer (its stand-in says `holds_state = False`) loads none, as DeepSpeed skips the
    optimizer state when its engine has no optimizer, whatever `load_optimizer_states` says."""
    if not getattr(inner, "holds_state", True):
        log_rank0(logger, "this engine has no optimizer: the checkpoint's %s state is not loaded", saved["class"])
        return
    if saved["class"] != type(inner).__name__:
        raise CheckpointError(f"the checkpoint's optimizer state is {saved['class']}'s; this engine steps with "
                              f"{type(inner).__name__} (use load_optimizer_states=False to start it afresh)")
    mapping = group_mapping(groups, inner, saved)
    state_dict = inner.state_dict()
    for pg, old in zip(state_dict["param_groups"], mapping):
        if old is not None:  # an empty group with no saved counterpart keeps its options
            pg.update({k: v for k, v in saved["options"][old].items() if k in pg})
    first_name = {}
    for group in groups:
        for index, tensor in enumerate(group.optimizer_tensors):
            first_name[id(tensor)] = group.records[group.layout.buckets[index].param_indices[0]].name
    state: dict[int, dict[str, Any]] = {}
    position = 0
    for pg in inner.param_groups:
        for tensor in pg["params"]:
            values = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in saved["scalars"].get(first_name[id(tensor)], {}).items()}
            values.update(elementwise.get(id(tensor), {}))
            if values:
                state[position] = values
            position += 1
    state_dict["state"] = state
    inner.load_state_dict(state_dict)


def remap_scheduler_state(state: dict[str, Any], mapping: list[int | None], saved_groups: int) -> dict[str, Any]:
    """Per-param-group lists in a scheduler's state (`base_lrs`, `_last_lr`) follow `mapping`; an
    empty group with no saved counterpart takes the first saved group's entry (its rate moves nothing)."""
    if mapping == list(range(saved_groups)):
        return state
    return {k: ([v[0 if m is None else m] for m in mapping] if isinstance(v, (list, tuple)) and len(v) == saved_groups
                else v)
            for k, v in state.items()}
