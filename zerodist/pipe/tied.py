"""Tied layers across stages: one module (an embedding and the head that reuses its weight) held by
several pipeline stages, kept equal.

[Note: tied gradients] Each stage that holds a tied module has its own copy (of the whole module:
`PipelineModule.tied_parameters`). The copies start
equal (`sync_weights`: a broadcast from the lowest pipe rank over the tie group, before ZeRO
flattens them) and stay equal if every copy steps with the same gradient: the sum of every
stage's. ZeRO's reducer accumulates and reduces gradients in its own flat buckets, whose layout
differs from stage to stage, so the tie reduction happens before it sees them: a gradient hook on
each tied parameter takes the gradient of every micro-batch into an accumulator of this class and
hands autograd zeros instead. After the batch's last backward, `reduce()` sums the accumulators
over the tie group (one all-reduce per key) and feeds the sum to the parameter as one more
backward, which the reducer adds to its buckets like any other; the data-parallel reduction that
follows then averages the tie sum over the data ranks, as it does every gradient. The tie group
pairs the ranks of the stages holding the key that share every other coordinate (data, tensor, ...):
`Topology`'s pipe groups, picked by `zerodist.pipe.apply.tie_group_ranks`.

The global gradient norm counts each tied parameter once: only on the tie group's first stage. The
copies on the others are declared `declare_counted_elsewhere` ([Note: copies counted elsewhere] in
zerodist/comm/domains.py), which ZeRO's step reads; no domain spans the pipe axis.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.domains import declare_counted_elsewhere
from zerodist.pipe.module import PipelineModule

__all__ = ["TiedGradients"]


class TiedGradients:
    """The tie groups of a PipelineModule's tied keys, and the gradient path described above."""

    def __init__(self, module: PipelineModule, tie_ranks: dict[str, list[list[int]]]):
        """`tie_ranks`: for each tied key held by two pipe ranks or more, every tie group's global
        ranks (one per coordinate of the other axes), as the topology gives them
        (`zerodist.pipe.apply.tie_group_ranks`); every rank makes every group, in this order."""
        self.module = module
        me = comm.get_rank()
        self.groups: dict[str, tuple[Any, int]] = {}  # key -> (group, source rank) for the keys this rank holds
        for key in sorted(tie_ranks):
            for ranks in tie_ranks[key]:
                group = comm.new_group(ranks)
                if me in ranks:
                    self.groups[key] = (group, ranks[0])
        self._accumulated: dict[int, torch.Tensor] = {}
        self._feeding = False
        self._handles: list[Any] = []
        self.rebind()

    def rebind(self) -> None:
        """Take the tied parameters the module holds now (after tensor parallelism swapped a tied
        embedding and its head for their vocab-parallel slices, which the tie groups pair by
        tensor index): the hooks go on them, and the copies counted elsewhere are declared again."""
        self.remove_hooks()
        me = comm.get_rank()
        self._params = {key: params for key, params in self.module.tied_parameters().items() if key in self.groups}
        for key, (_, source) in self.groups.items():
            if source != me:  # the tie group's first stage counts the key's parameters in the norm
                declare_counted_elsewhere(self.module.tied_module(key))
        self._handles = [p.register_hook(functools.partial(self._take, id(p)))
                         for params in self._params.values() for p in params]

    @property
    def parameters_by_key(self) -> dict[str, list[torch.nn.Parameter]]:
        """The tied parameters this rank holds and reduces, by key."""
        return dict(self._params)

    @property
    def active(self) -> bool:
        return bool(self._params)

    def sync_weights(self) -> None:
        """Every copy takes the lowest pipe rank's values (collective over each tie group)."""
        with torch.no_grad():
            for key, params in self._params.items():
                group, source = self.groups[key]
                for param in params:
                    comm.broadcast(param.data, src=source, group=group)

    def _take(self, key: int, grad: torch.Tensor) -> torch.Tensor | None:
        if self._feeding:
            return None  # reduce()'s own backward: the sum goes through unchanged
        if key in self._accumulated:
            self._accumulated[key].add_(grad)
        else:
            self._accumulated[key] = grad.detach().clone()
        return torch.zeros_like(grad)

    def reduce(self) -> None:
        """Sum this batch's tied gradients over their tie groups and hand them to autograd
        (collective over each tie group; call after the batch's last backward)."""
        for key, params in self._params.items():
            group, _ = self.groups[key]
            for param in params:
                accumulated = self._accumulated.pop(id(param), None)
                total = accumulated if accumulated is not None else torch.zeros_like(param)
                comm.all_reduce(total, group=group)
                self._feeding = True
                try:
                    torch.autograd.backward(param.view_as(param), total.to(param.dtype))
                finally:
                    self._feeding = False

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
