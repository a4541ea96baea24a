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

Three more declarations live here for the same reason: `declare_logical_offset` (a container of
local experts is part of a larger logical model: `logical_names`, which checkpoints use),
`declare_expert_parallel` (the expert degree a module was built for, which the engine's topology
takes) and `declare_counted_elsewhere` (this rank's parameters are copies that another rank
counts in the gradient norm: [Note: copies counted elsewhere]).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable

import torch

from zerodist import compat
from zerodist.comm.errors import TopologyError
from zerodist.comm.topology import AXES, DENSE, Domain


@dataclasses.dataclass(frozen=True)
class Placement:
    """A parameter's domain, and for a slice of a larger logical tensor, how it was cut:
    `slice_dim` of the logical tensor is split evenly over mesh axis `slice_axis`, this rank
    holding part `coords[slice_axis]`. `None` for a whole tensor.

    Two refinements of an even split, declared by tensor parallelism: `fused` (sub-tensor lengths
    along `slice_dim`, each split on its own: a fused QKV weight's part is `[q_r; k_r; v_r]`) and
    `logical_size` (the logical length along `slice_dim` when the parts are padded beyond it: a
    vocabulary the degree does not divide).

    `in_norm`: whether this rank counts the parameter in the global gradient norm (besides what
    the domain says); False for a copy another rank counts ([Note: copies counted elsewhere])."""

    domain: Domain
    slice_dim: int | None = None
    slice_axis: str | None = None
    fused: tuple[int, ...] = ()
    logical_size: int | None = None
    in_norm: bool = True

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
    # Copies counted elsewhere keep their domain and slicing, whoever declared those.
    for module in model.modules():
        if module in _COUNTED_ELSEWHERE:
            for param in module.parameters():
                found[id(param)] = dataclasses.replace(found[id(param)], in_norm=False)
    return found


def buffer_placements(model: torch.nn.Module) -> dict[int, Placement]:
    """`id(buffer)` -> Placement for every buffer of `model`: a declaration covering every
    parameter below a module (`names=None`) covers its buffers too; others are dense."""
    found: dict[int, Placement] = {id(b): DENSE_PLACEMENT for b in model.buffers()}
    for module in model.modules():  # pre-order: a deeper declaration wins
        entries = _DECLARED.get(module)
        if entries and "" in entries:
            for buffer in module.buffers():
                found[id(buffer)] = entries[""]
    return found


# ---------------------------------------------------------------------------------------- copies counted elsewhere
# [Note: copies counted elsewhere] A domain says over which mesh axes a parameter is replicated, and
# only index 0 along the axes it is replicated over but not reduced over counts it in the global
# gradient norm (`Topology.counts_in_norm`). Pipeline stages hold different layers, so no domain
# spans the pipe axis; but a tied layer (an embedding and the head that reuses it) is held whole by
# several stages, each copy stepping with the same summed gradient. Counted by every stage, its
# squares would enter the norm once per copy. So the rank that builds such a copy and knows it is
# not the one to count it declares it here, and its placement says `in_norm=False`: ZeRO's step
# leaves those parameters out of this rank's sum of squares (DeepSpeed marks the same parameters
# with a `ds_pipe_replicated` attribute; here nothing is written on them). A weak set of modules,
# like the placements: a declaration covers every parameter below the module.
_COUNTED_ELSEWHERE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def declare_counted_elsewhere(module: torch.nn.Module) -> None:
    """Declare that every parameter below `module` is, on this rank, an equal copy of a parameter
    another rank counts in the global gradient norm ([Note: copies counted elsewhere])."""
    _COUNTED_ELSEWHERE.add(module)


# ---------------------------------------------------------------------------------------- logical names
# [Note: logical names] A rank that holds a part of a larger logical model names its parameters as
# that model would: a container of local experts whose child k is the model's expert k + offset
# (expert-parallel rank r of E experts in groups of E_local holds experts r*E_local ...), so the
# checkpoint keys by global expert id and reshards across expert-parallel sizes. Kept, like the
# placements, in a weak side table: nothing is written on the container.
_OFFSETS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
# module -> the expert-parallel degree it was built for (an MoE layer's ep_size)
_EXPERT_DEGREES: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def declare_logical_offset(container: torch.nn.Module, offset: int) -> None:
    """Declare that `container`'s child named `k` (an integer, as in a ModuleList) is child
    `k + offset` of the logical model ([Note: logical names])."""
    if not isinstance(offset, int) or offset < 0:
        raise TopologyError(f"a logical offset is a non-negative integer, got {offset!r}")
    names = [name for name, _ in container.named_children()]
    if not names or not all(name.isdigit() for name in names):
        raise TopologyError(f"{type(container).__name__} must have integer-named children (as a ModuleList) to be "
                            f"offset; it has {names or 'none'}")
    _OFFSETS[container] = offset


def logical_names(model: torch.nn.Module) -> dict[int, str]:
    """`id(param)` -> the parameter's name in the logical model: its `named_parameters()` name,
    with the child index of every offset container shifted ([Note: logical names])."""
    keys = logical_keys(model)
    return {id(param): keys[name] for name, param in model.named_parameters()}


def logical_keys(model: torch.nn.Module) -> dict[str, str]:
    """Every `state_dict()` key of `model` (parameters, buffers, tied aliases) -> its key in the
    logical model ([Note: logical names])."""
    prefixes: dict[str, str] = {}

    def visit(module: torch.nn.Module, physical: str, logical: str) -> None:
        prefixes[physical] = logical
        offset = _OFFSETS.get(module, 0)
        for name, child in compat.registered_children(module):  # as state_dict() walks: twice if registered twice
            if child is not None:
                shifted = str(int(name) + offset) if offset else name
                visit(child, f"{physical}{name}.", f"{logical}{shifted}.")

    visit(model, "", "")
    keys = {}
    for key in model.state_dict(keep_vars=True):
        module_path, _, leaf = key.rpartition(".")
        physical = f"{module_path}." if module_path else ""
        keys[key] = prefixes.get(physical, physical) + leaf  # a key no module path explains stays as it is
    return keys


def declare_expert_parallel(module: torch.nn.Module, degree: int) -> None:
    """Declare that `module` (e.g. an MoE layer) was built for an expert axis of `degree` ranks:
    `zerodist.initialize` builds its topology with that expert degree."""
    if not isinstance(degree, int) or degree < 1:
        raise TopologyError(f"an expert-parallel degree is a positive integer, got {degree!r}")
    _EXPERT_DEGREES[module] = degree


def expert_parallel_degree(model: torch.nn.Module) -> int:
    """The expert degree the modules of `model` were built for (1 when none declared one)."""
    declared = {f"{name or '<root>'}": _EXPERT_DEGREES[m] for name, m in model.named_modules() if m in _EXPERT_DEGREES}
    degrees = set(declared.values())
    if len(degrees) > 1:
        listed = ", ".join(f"{name}: {degree}" for name, degree in declared.items())
        raise TopologyError(f"the model's modules were built for different expert-parallel degrees ({listed}); "
                            "one model runs on one mesh, so give every MoE layer the same ep_size")
    return degrees.pop() if degrees else 1
