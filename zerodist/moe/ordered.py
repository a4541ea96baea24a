"""The layout-invariant mode's expert hook (docs/determinism.md, [Note: the canonical tree] in
zerodist/zero/canonical.py): an expert's weight gradient is the canonical tree over the
micro-batches its tokens came from, whatever the expert degree and ZeRO stage.

[Note: experts in the mode] An expert-parallel layer runs each local expert once per source
rank's block (zerodist/moe/experts.py), so in a micro-step the expert's weight gets one gradient
per source rank of its expert group, which autograd would add in its own order. In the mode each
block calls the expert with its own alias of every weight (`_FanOut`: ep views of the parameter,
one autograd node), whose backward receives the ep per-source gradients at once and hands the
parameter their sum in the tree's order:
- interleaved dealing (ZeRO 2/3, a reduction every micro-step): the sources of micro-step j are
  micro-batches j*D + s, s over the expert group (consecutive batch ranks: expert is the innermost
  batch axis), an aligned block: their counter sum is a subtree, and the expert-data reduction and
  the micro-steps' counter go on up the tree. Window 1: the sum goes out every backward.
- contiguous dealing (ZeRO 0/1, one reduction per step): the sources of micro-step j are s*A + j,
  not a block; the window is the whole step: each backward's per-source gradients are kept (the
  parameter gets zeros, exactly neutral in the buffer's accumulation) and the step's last backward
  hands it the counter over all A x ep of them in micro-batch order, the aligned block of the
  expert group's micro-batches. Extra memory: A x ep x the rank's expert parameters, until then.
With a pipeline (any PipelineModule, all its stages on one rank included: engine/initialize.py
`_expert_dealing` decides as the sampler does) the dealing is contiguous at every ZeRO stage (one
reduction per step), so the window is the step, and the pipeline's per-micro-batch tree
(engine/pipeline_invariant.py) adds the zeros and the one sum exactly; a leaf's place in the window
is its stage's backward count (micro-batch order under 1F1B, GPipe, ZB-H1; canonical.check_layout
refuses the other schedules with experts).
The order comes from the engine as `index(source, micro_step) -> k` (moe sits beside zero and
does not import it); the engine also gives the counter (`tree_sum`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass
class ExpertOrder:
    """How one expert container's per-source gradients are summed in the mode."""

    sources: int                                   # the expert degree: blocks per local expert
    window: int                                    # backwards per sum: A (contiguous) or 1 (interleaved)
    index: Callable[[int, int], int]               # (source, backward in window) -> micro-batch k
    tree_sum: Callable[[list[torch.Tensor]], torch.Tensor]  # the canonical counter over leaves in order
    kept: dict[int, list[tuple[int, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    seen: dict[int, int] = dataclasses.field(default_factory=dict)  # id(param) -> backwards in this window

    def combine(self, param: nn.Parameter, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One backward's per-source gradients of `param`: the window's tree sum at its last backward, else zeros."""
        key = id(param)
        step = self.seen.get(key, 0)
        leaves = self.kept.setdefault(key, [])
        for source, grad in enumerate(grads):
            leaves.append((self.index(source, step), grad if grad is not None else torch.zeros_like(param)))
        if step + 1 < self.window:
            self.seen[key] = step + 1
            return torch.zeros_like(param)
        del self.kept[key]
        self.seen.pop(key, None)
        return self.tree_sum([leaf for _, leaf in sorted(leaves, key=lambda pair: pair[0])])


_ORDERS: weakref.WeakKeyDictionary[nn.Module, ExpertOrder] = weakref.WeakKeyDictionary()


def set_expert_order(container: nn.Module, order: ExpertOrder | None) -> None:
    """Sum `container`'s (an `Experts`) per-source gradients in `order` (None: autograd's order)."""
    if order is None:
        _ORDERS.pop(container, None)
    else:
        _ORDERS[container] = order


def expert_order(container: nn.Module) -> ExpertOrder | None:
    return _ORDERS.get(container)


class _FanOut(torch.autograd.Function):
    """`sources` aliases of one parameter; backward: their gradients combined by the order."""

    @staticmethod
    def forward(ctx: Any, order: ExpertOrder, param: torch.Tensor, sources: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.order, ctx.param = order, param
        return tuple(param.view_as(param) for _ in range(sources))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, torch.Tensor, None]:  # type: ignore[override]
        return None, ctx.order.combine(ctx.param, grads), None


def per_source_weights(expert: nn.Module, order: ExpertOrder) -> list[dict[str, torch.Tensor]]:
    """For each source block: the expert's parameters as that block's own aliases ([Note: experts in the mode])."""
    named = list(expert.named_parameters())
    fanned = [_FanOut.apply(order, param, order.sources) for _, param in named]
    return [{name: aliases[source] for (name, _), aliases in zip(named, fanned)} for source in range(order.sources)]


def call_with(expert: nn.Module, weights: dict[str, torch.Tensor], block: torch.Tensor) -> Any:
    return torch.func.functional_call(expert, weights, (block,))
