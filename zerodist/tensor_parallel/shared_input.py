"""One "copy to the tensor region" for the column-parallel layers that read the same input.

Megatron's f (identity forward, all-reduce of the gradient backward) sits before each
column-parallel layer. When several column layers read one tensor (a Llama attention's q, k and v
projections of the normalised hidden state; its MLP's gate and up projections), a copy per layer
all-reduces the gradient of that one tensor once per layer: 5 all-reduces per Llama block where
Megatron's fused QKV and fused gate/up need 2. torchtitan prepares the input once per module
instead (`PrepareModuleInput` on the attention and on the MLP).

`SharedInput` is that preparation. Attached to a module (the plan's `PrepareInput()` entry), it
opens a scope for the module's forward (forward pre-hook and forward hook, through torch's hook
API: nothing is set on the module). Inside the scope, the first column layer to read a tensor `x`
applies the copy (`copy_to_tensor_region`, or under sequence parallelism the all-gather along the
sequence, `gather_from_sequence_region`) and records `(x, prepared)`; every later column layer that
reads the *same tensor object* uses `prepared` and reduces nothing itself. The gradients of all
those layers accumulate on `prepared`, and its one backward reduction sums them over the tensor
ranks: the same sum, once.

The backward keeps Megatron's overlap: the group's layers hand their input gradients to the group
(`SharedGroup`) instead of to autograd, and the last of them to run its backward sums them, starts
the one reduction asynchronously, computes its own weight gradient meanwhile, and waits; the copy's
backward then returns the reduced sum. Should a layer of the group not take part in a backward (its
output did not reach the loss), the copy's backward finds the group incomplete and reduces what it
holds there, synchronously: the same sum.

Sharing is by the identity of the tensor, so it is correct whatever the module's code does: a
column layer that reads another tensor (a cross-attention's encoder states, `x.float()`) gets its
own copy, and a tensor the module reads in any other way (a residual, a replicated layer) is not
`prepared` and its gradient is not reduced. The scope is per thread (Domino runs its chunks in
threads, each inside its own call of the module) and holds its tensors only for the forward.

`detach_shared_inputs(model)` takes the scopes' hooks off the user's modules again (the engine's
`destroy()`); the converted layers then reduce for themselves, one reduction per layer: the same
sums, exact, only more of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodist.tensor_parallel import operators as ops
from zerodist.tensor_parallel.operators import TensorRegion


class SharedGroup:
    """The column-parallel layers that read one tensor in one forward of a prepared module."""

    __slots__ = ("users", "arrived", "partials", "reduced", "sequence_dim")

    def __init__(self, sequence_dim: int | None):
        self.users = 0       # layers that read the copy in forward
        self.arrived = 0     # of them, those whose backward has run (this backward)
        self.partials: list[torch.Tensor] = []  # their input gradients, until the last one sums them
        self.reduced: torch.Tensor | None = None  # the reduced sum, for the copy's backward
        self.sequence_dim = sequence_dim


class _SharedCopy(torch.autograd.Function):
    """Forward: identity (under sequence parallelism: all-gather along the sequence). Backward: the
    group's reduced input gradient (see the module docstring); no gradient arrives here otherwise."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, region: TensorRegion, group: SharedGroup) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.region, ctx.group = region, group
        if group.sequence_dim is None:
            return x.view_as(x)
        return ops.all_gather_dim(x, group.sequence_dim, region)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        group: SharedGroup = ctx.group
        # Normally the group's last layer has reduced the sum (`reduced`) and nothing else arrives.
        # Otherwise (a layer of the group did not run its backward: its output did not reach the
        # loss) the input gradients it holds are reduced here, synchronously.
        reduced, group.reduced = group.reduced, None
        parts = group.partials + ([grad] if grad is not None else [])
        group.partials, group.arrived = [], 0
        if parts:
            total = torch.stack(parts).sum(0) if len(parts) > 1 else parts[0].clone()
            if group.sequence_dim is None:
                ops.all_reduce_(total, ctx.region)
            else:
                total = ops.reduce_scatter_dim(total, group.sequence_dim, ctx.region)
            reduced = total if reduced is None else reduced + total
        return reduced, None, None


class SharedInput:
    """The scope of one module's input preparation (see the module docstring)."""

    def __init__(self, region: TensorRegion, sequence_parallel: bool = False):
        self.region, self.sequence_parallel = region, sequence_parallel
        self._local = threading.local()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _scopes(self) -> list[dict[int, tuple[torch.Tensor, torch.Tensor, SharedGroup]]]:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def open(self) -> None:
        self._scopes().append({})

    def close(self) -> None:
        scopes = self._scopes()
        if scopes:
            scopes.pop()

    def attach(self, module: nn.Module, *, at_entry: bool = False) -> None:
        """Open the scope for each forward of `module` (and close it, even when the forward raises).
        `at_entry`: the module's first input (positional, or `hidden_states`) is prepared as the
        module is called and handed to its forward prepared, so the module's own code sees the
        whole sequence under sequence parallelism; its column layers then read the prepared tensor
        and share its one reduction, as they would share a copy made by the first of them."""
        if at_entry:
            def open_and_prepare(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
                self.open()
                return first_input_hook(self._prepare_at_entry)(module, args, kwargs)

            self._handles.append(module.register_forward_pre_hook(open_and_prepare, with_kwargs=True))
        else:
            self._handles.append(module.register_forward_pre_hook(lambda _module, _args: self.open()))
        self._handles.append(module.register_forward_hook(lambda _module, _args, _output: self.close(),
                                                          always_call=True))

    def detach(self) -> None:
        """Remove the hooks `attach` registered: no scope opens any more."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, SharedGroup] | None:
        """`x` copied to the tensor region (gathered along the sequence under sequence
        parallelism) once per scope, and its group, which the calling layer joins; None outside a
        scope (the layer reduces for itself)."""
        scopes = self._scopes()
        if not scopes:
            return None
        entries = scopes[-1]
        found = entries.get(id(x))
        if found is None or found[0] is not x:
            group = SharedGroup(x.dim() - 2 if self.sequence_parallel else None)
            # x is held with its copy, so its id stays its own while the scope lives
            found = entries[id(x)] = (x, _SharedCopy.apply(x, self.region, group), group)
        found[2].users += 1
        return found[1], found[2]


    def _prepare_at_entry(self, x: torch.Tensor) -> torch.Tensor:
        if self.region.size == 1:
            return x
        group = SharedGroup(x.dim() - 2 if self.sequence_parallel else None)
        prepared = _SharedCopy.apply(x, self.region, group)
        self._scopes()[-1][id(prepared)] = (prepared, prepared, group)  # the layers reading it share it
        return prepared


def first_input_hook(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A forward pre-hook (with kwargs) that replaces the module's first input, positional or
    `hidden_states`, by `change(input)`."""
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            return (change(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        return None
    return hook


def detach_shared_inputs(model: nn.Module) -> int:
    """Take every `SharedInput` scope off `model`'s modules and out of its column-parallel layers
    (zerodist's own layers: their `shared_input`), which then reduce their input gradients for
    themselves. Returns how many scopes there were."""
    scopes: dict[int, SharedInput] = {}
    for layer in model.modules():
        scope = getattr(layer, "shared_input", None)  # only zerodist's column-parallel layers have one
        if isinstance(scope, SharedInput):
            scopes[id(scope)] = scope
            setattr(layer, "shared_input", None)  # the layer's own field (nn.Module's stubs type it as a child)
    for scope in scopes.values():
        scope.detach()
    return len(scopes)
