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

Sharing is by the identity of the tensor, so it is correct whatever the module's code does: a
column layer that reads another tensor (a cross-attention's encoder states, `x.float()`) gets its
own copy, and a tensor the module reads in any other way (a residual, a replicated layer) is not
`prepared` and its gradient is not reduced. The scope is per thread (Domino runs its chunks in
threads, each inside its own call of the module) and holds its tensors only for the forward.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from zerodist.tensor_parallel import operators as ops
from zerodist.tensor_parallel.operators import TensorRegion


class SharedInput:
    """The scope of one module's input preparation (see the module docstring)."""

    def __init__(self, region: TensorRegion, sequence_parallel: bool = False):
        self.region, self.sequence_parallel = region, sequence_parallel
        self._local = threading.local()

    def _scopes(self) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
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

    def attach(self, module: nn.Module) -> None:
        """Open the scope for each forward of `module` (and close it, even when the forward raises)."""
        module.register_forward_pre_hook(lambda _module, _args: self.open())
        module.register_forward_hook(lambda _module, _args, _output: self.close(), always_call=True)

    def prepare(self, x: torch.Tensor) -> torch.Tensor | None:
        """`x` copied to the tensor region (gathered along the sequence under sequence
        parallelism), once per scope; None outside a scope (the layer reduces for itself)."""
        scopes = self._scopes()
        if not scopes:
            return None
        entries = scopes[-1]
        found = entries.get(id(x))
        if found is not None and found[0] is x:
            return found[1]
        if self.sequence_parallel:
            prepared = ops.gather_from_sequence_region(x, self.region, dim=-2)
        else:
            prepared = ops.copy_to_tensor_region(x, self.region)
        entries[id(x)] = (x, prepared)  # x held too: its id stays its own while the scope lives
        return prepared
