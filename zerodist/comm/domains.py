"""The side table of declared sharding domains: which parameters are not plain dense ones.

`zerodist.moe` and `zerodist.tensor_parallel` *declare* where the parameters of the modules they
build or convert live (an expert's, a tensor-parallel slice's); `zerodist.zero` and the engine
*read* the declarations through `parameter_placements(model)`. Nothing is written on the user's
modules or parameters: the table is keyed weakly by module (not by parameter: torch's
`swap_tensors`, used to materialise meta-built models, refuses weakly referenced tensors), and a
module that dies takes its declarations with it.

A parameter nobody declared is dense (`DENSE`). A declaration on a module covers the named
parameters of that module itself, or all parameters below it; a declaration on a module deeper
in the tree wins over one on its ancestor.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable

import torch

from zerodist.comm.errors import TopologyError
from zerodist.comm.topology import AXES, DENSE, Domain


@dataclasses.dataclass(frozen=True)
class Placement:
    """A parameter's domain, and for a slice of a larger logical tensor, how it was cut:
    `slice_dim` of the logical tensor is split evenly over mesh axis `slice_axis`, this rank
    holding part `coords[slice_axis]`. `None` for a whole tensor."""

    domain: Domain
    slice_dim: int | None = None
    slice_axis: str | None = None

    def __post_init__(self) -> None:
        if (self.slice_dim is None) != (self.slice_axis is None):
            raise TopologyError("a sliced placement names both slice_dim and slice_axis, or neither")
        if self.slice_axis is not None and self.slice_axis not in AXES:
            raise TopologyError(f"unknown axis {self.slice_axis!r}; the axes are {', '.join(AXES)}")


DENSE_PLACEMENT = Placement(DENSE)

# module -> {parameter name local to the module, or "" for every parameter below it: Placement}
_DECLARED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Placement]] = weakref.WeakKeyDictionary()


def declare_placement(module: torch.nn.Module, placement: Placement | Domain, *, names: Iterable[str] | None = None) -> None:
    """Declare that `module`'s parameters `names` (default: every parameter below it) live in
    `placement` (a `Placement`, or a bare `Domain` for whole tensors)."""
    if isinstance(placement, Domain):
        placement = Placement(placement)
    entries = _DECLARED.setdefault(module, {})
    if names is None:
        entries[""] = placement
        return
    own = dict(module.named_parameters(recurse=False))
    for name in names:
        if name not in own:
            raise TopologyError(f"{type(module).__name__} has no parameter {name!r} of its own to declare "
                                f"(it has {sorted(own) or 'none'})")
        entries[name] = placement


def parameter_placements(model: torch.nn.Module) -> dict[int, Placement]:
    """`id(param)` -> Placement for every parameter of `model` (undeclared ones are dense)."""
    found: dict[int, Placement] = {id(p): DENSE_PLACEMENT for p in model.parameters()}
    # modules() is pre-order, so a deeper declaration is applied after (over) its ancestor's.
    for module in model.modules():
        entries = _DECLARED.get(module)
        if not entries:
            continue
        if "" in entries:
            for param in module.parameters():
                found[id(param)] = entries[""]
        for name, param in module.named_parameters(recurse=False):
            if name in entries:
                found[id(param)] = entries[name]
    return found
