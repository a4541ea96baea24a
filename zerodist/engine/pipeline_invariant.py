"""The layout-invariant mode's pipeline hook (docs/determinism.md, [Note: the canonical tree] in
zerodist/zero/canonical.py): each stage's gradient is the same canonical tree over micro-batches
whatever the schedule's backward order.

[Note: pipeline gradients by micro-batch] A schedule runs a rank's backwards in its own order
(1F1B interleaves them with forwards, ZB-H1 runs the weight passes W late, interleaved and V
schedules alternate stages), and ZeRO's buckets add each backward's gradient as it comes: an order
the one-process run does not share once A > 2. In the mode, `PipelineGradients` keeps every
parameter's gradient of each micro-batch apart (a reducer observer: the tensor autograd made,
no copy), attributed by the schedule: the executor calls `after_backward()` once after each B and
W action (I writes no weight gradient), so the gradients seen before the n-th call are those of
the n-th B/W action in the rank's action list. When every stage is done (before the one
data-parallel reduction) `finish()`:
- sums each tied parameter's per-micro-batch gradients over its tie group (an all-gather, then the
  members' copies in tie-group rank order): for a tie over two stages that is e_k + h_k, the bits
  autograd gives one process for a module used twice in micro-batch k (addition commutes); the
  TiedGradients hook, which would sum over micro-batches first, is off in the mode;
- adds each parameter's micro-batch gradients 0..A-1 by the binary counter, in micro-batch index
  order (a micro-batch without a gradient is a zero leaf, as in one process), and writes the sum
  over what the bucket accumulated.
The data-parallel reduction then adds the D ranks' subtrees in rank order, as without a pipeline;
a pipeline deals micro-batches contiguously (data rank r runs r*A .. r*A+A-1) at every ZeRO stage,
since it reduces once per step. Extra memory: the A micro-batch gradients of the rank's stages
until the reduction (A x Psi_stage x b), and the tie sum's gather (tie size x A x the tied numel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.pipe.schedule import Action, Kind
from zerodist.zero.canonical import CanonicalSum
from zerodist.zero.flat_group import FlatParamGroup


class PipelineGradients:
    """Per-micro-batch gradients of one rank's stages, summed by the canonical tree ([Note: pipeline
    gradients by micro-batch])."""

    def __init__(self, groups: Sequence[FlatParamGroup], reducer: Any, tied: Any, micro_batches: int):
        self.tied, self.micro_batches = tied, micro_batches
        self.slot_of = {id(p): (g, i) for g in groups for i, p in enumerate(g.params)}
        self.order: list[int] = []   # the micro-batch of each B / W action, in the rank's run order
        self.done = 0                # after_backward() calls so far in this run
        self.running = False
        self.leaves: dict[int, dict[int, torch.Tensor]] = {}  # id(param) -> {micro-batch: its gradient}
        reducer.grad_observers.append(self._observe)

    def begin(self, actions: Sequence[Action]) -> None:
        self.order = [a.microbatch for a in actions if a.kind in (Kind.B, Kind.W)]
        self.done, self.running, self.leaves = 0, True, {}
        if self.tied is not None:
            self.tied.remove_hooks()  # the mode sums ties per micro-batch here (idempotent)

    def after_backward(self, then: Callable[[], None]) -> Callable[[], None]:
        def called() -> None:
            self.done += 1
            then()
        return called

    def _observe(self, group: FlatParamGroup, index: int, grad: torch.Tensor) -> None:
        if not self.running:
            return
        assert self.done < len(self.order), "a gradient after the schedule's last backward"
        micro = self.order[self.done]
        by_micro = self.leaves.setdefault(id(group.params[index]), {})
        if micro in by_micro:
            by_micro[micro] = by_micro[micro] + grad  # one module on two of this rank's stages: commutes
        else:
            by_micro[micro] = grad.detach()  # autograd's tensor: the reducer drops param.grad next

    def finish(self) -> None:
        """The tie sums, then each parameter's tree over micro-batches into its bucket (before the
        data-parallel reduction; collective over the tie groups)."""
        assert self.done == len(self.order), (
            f"the executor called after_backward {self.done} times for {len(self.order)} B/W actions")
        self.running = False
        self._sum_ties()
        for key, by_micro in self.leaves.items():
            group, index = self.slot_of[key]
            like = next(iter(by_micro.values()))
            total = CanonicalSum()
            for micro in range(self.micro_batches):
                leaf = by_micro.get(micro)
                total.push(leaf.clone() if leaf is not None else torch.zeros_like(like))
            summed = total.fold()
            assert summed is not None
            bucket = group.grads.buckets[group.layout.slots[index].bucket]
            bucket.unwritten.add(index)  # overwrite what the bucket added in arrival order
            bucket.write_grad(index, summed)
        self.leaves = {}

    def _sum_ties(self) -> None:
        """Each tied parameter's micro-batch gradients summed over its tie group, micro-batch by
        micro-batch, the members in tie-group rank order (collective over each tie group)."""
        if self.tied is None or not self.tied.active:
            return
        for key, params in self.tied.parameters_by_key.items():
            group, _ = self.tied.groups[key]
            members = comm.get_world_size(group)
            for param in params:
                by_micro = self.leaves.setdefault(id(param), {})
                mine = torch.stack([by_micro[m] if m in by_micro else torch.zeros(tuple(param.shape), dtype=param.dtype,
                                                                                 device=param.device)
                                    for m in range(self.micro_batches)]).reshape(-1)
                every = torch.empty(members * mine.numel(), dtype=mine.dtype, device=mine.device)
                comm.all_gather(every, mine, group=group)
                pieces = every.view(members, self.micro_batches, *param.shape)
                for micro in range(self.micro_batches):
                    total = CanonicalSum()
                    for member in range(members):
                        total.push(pieces[member, micro].clone())
                    summed = total.fold()
                    assert summed is not None
                    by_micro[micro] = summed
