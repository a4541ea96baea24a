"""Stage 3: tensors autograd saves that are views of a unit's gathered parameters, saved as descriptors.

[Note: saved parameter views] A unit freed after its forward (not kept for reuse, [Note: reuse
between forward and backward] in runtime.py) drops its gathered buffer, but autograd may still hold
it: `F.linear` saves `weight.t()`, a view of the gathered buffer, not the parameter itself (a
saved parameter follows its `.data`; a saved view keeps the old storage). Every freed unit's
buffer would so stay alive until its backward, which gathers the unit again into a new one:
gathered parameters would peak at twice the model instead of about one unit. DeepSpeed replaces
`nn.Linear`'s function for this (deepspeed/runtime/zero/linear.py); zerodist touches no user
module and uses PyTorch's `torch.autograd.graph.saved_tensors_hooks` instead, active during the
forward of each unit that will be freed (entered in a forward pre-hook after the gather, left in
a forward hook that runs even when the forward raises). Its pack hook looks the saved tensor's
storage up among the unit's gathered buffers (one dict lookup by address) and, on a hit, keeps a
small descriptor (group, size, stride, offset) instead of the tensor; the unpack hook rebuilds the
view with `as_strided` on the group's buffer as it is then. The unit's backward pre-hook has
gathered it again before any of its backward nodes run (the hook fires on the first gradient
reaching the unit's outputs, and the nodes that saved the views are inside the unit); a unit
found sharded at unpack (e.g. released by an activation-checkpoint recompute of the whole unit)
is gathered again through the runtime, never read as NaN. Other tensors go to the hooks that
were active outside the unit (a user's `save_on_cpu`, a checkpoint, a profiler) or are saved as
usual, so the same tensors reach those hooks in an activation checkpoint's forward and its
recompute. The values are the same ones: a gathered buffer holds the same shards every time
between two optimizer steps.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from zerodist import compat

if TYPE_CHECKING:
    from zerodist.zero.flat_group import FlatParamGroup
    from zerodist.zero.units import Unit


class _SavedView:
    """Where a saved tensor lay in a gathered buffer, to rebuild it at unpack."""

    __slots__ = ("group", "size", "stride", "offset")

    def __init__(self, group: weakref.ref, tensor: torch.Tensor):
        self.group, self.size, self.stride, self.offset = group, tensor.size(), tensor.stride(), tensor.storage_offset()


class _Outer:
    """What the hooks active outside the unit packed (their unpack gets it back)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]):
        self.packed, self.unpack = packed, unpack


class SavedParameterViews:
    """The saved-tensor hooks of one unit's forward (one per unit, entered and left by its hooks)."""

    def __init__(self, gather_again: Callable[[], None]):
        """`gather_again()` gathers the unit again for its backward (the schedule's; it holds the
        runtime weakly and raises if the engine is gone)."""
        self._gather_again = gather_again
        # one entry per forward of the unit in progress (None: hooks refused, saved as usual)
        self._active: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    def enter(self, unit: Unit) -> None:
        """After the unit's gather: save views of its buffers as descriptors until `leave`."""
        if not torch.is_grad_enabled() or not compat.saved_tensors_hooks_enabled():
            self._active.append(None)  # nothing saved, or hooks refused here (a compile transform): as usual
            return
        # address -> (group, dtype, device); nothing here holds a buffer
        buffers = {g.param_buffer.untyped_storage().data_ptr(): (weakref.ref(g), g.param_buffer.dtype,
                                                                 g.param_buffer.device)
                   for g in unit.groups if g.param_buffer is not None}
        outer = compat.outer_saved_tensors_hooks()
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: self._pack(tensor, buffers, outer), self._unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def leave(self) -> None:
        if self._active:
            hooks = self._active.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)

    @staticmethod
    def _pack(tensor: torch.Tensor, buffers: dict[int, Any], outer: Any) -> Any:
        if tensor.layout is torch.strided and not tensor.is_meta:
            hit = buffers.get(tensor.untyped_storage().data_ptr())
            if hit is not None and hit[1] == tensor.dtype and hit[2] == tensor.device:
                return _SavedView(hit[0], tensor)
        if outer is not None:
            return _Outer(outer[0](tensor), outer[1])
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, _SavedView):
            return packed
        group: FlatParamGroup | None = packed.group()
        if group is None:
            raise RuntimeError("ZeRO-3: a saved parameter view outlived its engine; run backward before "
                               "destroying the engine")
        if group.param_buffer is None:
            self._gather_again()
        assert group.param_buffer is not None, "the unit was gathered"
        return group.param_buffer.as_strided(packed.size, packed.stride, packed.offset)
