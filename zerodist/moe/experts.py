"""The expert container: this rank's local experts, declared as the `EXPERT` domain.

`Experts(expert, num_local_experts)` deep-copies the user's `expert` module once per local expert
into `deepspeed_experts` (DeepSpeed's name, so state-dict keys match:
`deepspeed_moe.experts.deepspeed_experts.{local id}.<param>`). The copies are zerodist's own
modules; the container declares them in the side table of `zerodist.comm.domains` and registers
itself in a weak set that `zerodist.moe.utils.is_moe_param` reads. Nothing is written on the
parameters: DeepSpeed's `param.allreduce = False` / `param.group_name` markers are not set (see
docs/moe.md for code that reads them).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from zerodist.comm.domains import declare_placement
from zerodist.comm.topology import EXPERT
from zerodist.moe.ordered import call_with, expert_order, per_source_weights


# Every live expert container; weak, so a dropped model leaves nothing behind.
_CONTAINERS: weakref.WeakSet[Experts] = weakref.WeakSet()


def expert_containers() -> Iterator[Experts]:
    return iter(list(_CONTAINERS))


class Experts(nn.Module):
    """`num_local_experts` copies of `expert`. `forward` takes DeepSpeed's `[ep, E_local, C, M]`
    capacity buffer and runs local expert l on `[:, l]`; `forward_rows` runs each expert on its
    own row blocks (dropless mode).

    [Note: one call per block] An expert runs once per source rank's block of tokens, not once
    on all of them: a matmul's rounding depends on its row count, so one call on ep * C rows
    would differ in the last bits from the ep_size=1 model, which sees each batch shard's C rows
    alone. Per-block calls make the outputs bitwise independent of ep_size (the weight gradients
    still differ by summation order, ~1e-7 relative), at the cost of ep calls per expert."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise TypeError(f"expert must be a torch.nn.Module, got {type(expert).__name__}")
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        declare_placement(self, EXPERT)
        _CONTAINERS.add(self)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`[ep, E_local, C, M]` -> same shape; see [Note: one call per block]."""
        order = expert_order(self)  # the layout-invariant mode: [Note: experts in the mode] in ordered.py
        outputs = []
        for local, expert in enumerate(self.deepspeed_experts):
            if order is not None and torch.is_grad_enabled():
                weights = per_source_weights(expert, order)
                blocks = [_first(call_with(expert, weights[source], inputs[source:source + 1, local:local + 1]))
                          for source in range(inputs.shape[0])]
            else:
                blocks = [_first(expert(inputs[source:source + 1, local:local + 1]))
                          for source in range(inputs.shape[0])]
            outputs.append(torch.cat(blocks, dim=0))
        return torch.cat(outputs, dim=1)

    def forward_rows(self, rows: torch.Tensor, block_rows: list[list[int]]) -> torch.Tensor:
        """Dropless: `rows` in blocks of `block_rows[source][local]` rows (source-major, as the
        all-to-all delivers them); expert `local` runs on each of its blocks, output in the same
        order. Every expert runs, even on zero rows, so every rank calls every expert module on
        every step."""
        sizes = [count for per_source in block_rows for count in per_source]
        blocks = rows.split(sizes, dim=0)
        num_local = self.num_local_experts
        order = expert_order(self)  # the layout-invariant mode: [Note: experts in the mode] in ordered.py
        if order is not None and torch.is_grad_enabled():
            weights = [per_source_weights(expert, order) for expert in self.deepspeed_experts]
            outputs = [_first(call_with(self.deepspeed_experts[i % num_local], weights[i % num_local][i // num_local],
                                        block)) for i, block in enumerate(blocks)]
        else:
            outputs = [_first(self.deepspeed_experts[i % num_local](block)) for i, block in enumerate(blocks)]
        return torch.cat(outputs, dim=0)


def _first(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    # DeepSpeed allows an expert to return (output, bias); the bias is ignored, as there.
    return output[0] if isinstance(output, tuple) else output
