"""Token dispatch and combine, on one rank or over the expert-parallel group.

Capacity mode (DeepSpeed's layout): the kept routes are copied into a zero-padded buffer
`[E, C, M]` (expert e's slot c at row e * C + c), one all-to-all sends each rank's `[E_local,
C, M]` block to the rank that owns those experts, so rank r receives `[ep, E_local, C, M]`; the
experts run; a second all-to-all sends the results back; each token sums its kept routes'
outputs times their weights. Backward mirrors the two all-to-alls: 4 per layer and step, each of
E * C * M elements.

Dropless mode: no padding. The routes are sorted by expert (token order within one expert); an
all-to-all of E int64 counts tells every rank how many rows it will get from each peer for each
of its experts; then a variable-split all-to-all moves exactly the routed rows, and the same in
reverse. Ranks may route differently and hold different token counts: nothing needs a `MAX`
all-reduce of capacities (DeepSpeed's, which hangs when ranks disagree, #6809).

Every collective goes through `zerodist.comm` (traced, guarded, labelled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerodist import comm
from zerodist.comm import Group
from zerodist.moe.gating import Routing


class _AllToAll(torch.autograd.Function):
    """DeepSpeed's `sharded_moe._AllToAll`: `apply(group, input)`, an all_to_all_single of equal
    splits along dim 0 whose backward is the same all-to-all. The capacity path's two all-to-alls
    go through `_AllToAll.apply`, looked up at call time (DeepSpeed's tests count them by patching it)."""

    @staticmethod
    def forward(ctx: Any, group: Group, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        rows = rows.contiguous()
        received = torch.empty_like(rows)
        comm.all_to_all_single(received, rows, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return None, _AllToAll.apply(ctx.group, grad.contiguous())


class _AllToAllSplits(torch.autograd.Function):
    """all_to_all_single along dim 0 with row splits, whose backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, group: Group, rows: torch.Tensor, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        comm.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        back = _AllToAllSplits.apply(ctx.group, grad.contiguous(), ctx.input_splits, ctx.output_splits)
        return None, back, None, None


def all_to_all(group: Group, rows: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all of `rows` over `group` (equal splits when the sizes are None)."""
    if output_splits is None and input_splits is None:
        return _AllToAll.apply(group, rows)
    assert output_splits is not None and input_splits is not None, "give both splits or neither"
    return _AllToAllSplits.apply(group, rows, output_splits, input_splits)


def _kept_routes(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, expert, slot, weight) of the kept routes, token-major order."""
    token, choice = routing.kept.nonzero(as_tuple=True)
    return token, routing.expert[token, choice], routing.slot[token, choice], routing.weight[token, choice]


@dataclasses.dataclass
class CapacityPlan:
    """Where each kept route sits in the `[E, C, M]` buffer."""

    num_tokens: int
    num_experts: int
    capacity: int
    token: torch.Tensor
    row: torch.Tensor
    weight: torch.Tensor


def plan_capacity(routing: Routing, num_experts: int) -> CapacityPlan:
    assert routing.capacity is not None, "capacity plan for a dropless routing"
    token, expert, slot, weight = _kept_routes(routing)
    return CapacityPlan(routing.kept.shape[0], num_experts, routing.capacity, token, expert * routing.capacity + slot, weight)


def dispatch_capacity(tokens: torch.Tensor, plan: CapacityPlan) -> torch.Tensor:
    """`[S, M]` tokens -> `[E, C, M]` buffer, zero where no route landed."""
    hidden = tokens.shape[1]
    buffer = tokens.new_zeros(plan.num_experts * plan.capacity, hidden)
    buffer = buffer.index_copy(0, plan.row, tokens[plan.token])
    return buffer.view(plan.num_experts, plan.capacity, hidden)


def combine_capacity(expert_output: torch.Tensor, plan: CapacityPlan) -> torch.Tensor:
    """`[E, C, M]` expert outputs -> `[S, M]`: each token's kept routes, times their weights, summed."""
    hidden = expert_output.shape[-1]
    rows = expert_output.reshape(-1, hidden)[plan.row] * plan.weight.to(expert_output.dtype)[:, None]
    return expert_output.new_zeros(plan.num_tokens, hidden).index_add(0, plan.token, rows)


@dataclasses.dataclass
class DroplessPlan:
    """The routed rows, sorted by expert, and how they travel.

    `send_token` / `send_weight`: the token and weight of each row sent, in send order (expert
    order, token order within an expert). `input_splits[p]` rows go to peer p,
    `output_splits[p]` come from it. `received_counts[p][l]`: rows from peer p for local expert
    l (the received rows are ordered by peer, then local expert)."""

    num_tokens: int
    send_token: torch.Tensor
    send_weight: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    received_counts: list[list[int]]


def plan_dropless(routing: Routing, num_experts: int, group: Group, ep_size: int) -> DroplessPlan:
    """Sort the routed rows by expert and exchange per-expert counts over the expert group."""
    token, expert, _, weight = _kept_routes(routing)
    order = torch.sort(expert, stable=True).indices
    # On the tokens' device (NCCL needs it there); the split sizes are read back on the host.
    counts = torch.bincount(expert, minlength=num_experts).to(torch.int64)
    num_local = num_experts // ep_size
    if ep_size > 1:
        received = torch.empty_like(counts)
        comm.all_to_all_single(received, counts, group=group)
    else:
        received = counts
    sent_blocks = counts.cpu().view(ep_size, num_local)
    received_blocks = received.cpu().view(ep_size, num_local)
    return DroplessPlan(
        num_tokens=routing.kept.shape[0], send_token=token[order], send_weight=weight[order],
        input_splits=sent_blocks.sum(dim=1).tolist(), output_splits=received_blocks.sum(dim=1).tolist(),
        received_counts=received_blocks.tolist(),
    )


def combine_dropless(returned_rows: torch.Tensor, plan: DroplessPlan) -> torch.Tensor:
    """Rows back in send order -> `[S, M]`, weighted and summed per token."""
    rows = returned_rows * plan.send_weight.to(returned_rows.dtype)[:, None]
    return returned_rows.new_zeros(plan.num_tokens, returned_rows.shape[1]).index_add(0, plan.send_token, rows)
