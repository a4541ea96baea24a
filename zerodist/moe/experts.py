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

# Every live expert container; weak, so a dropped model leaves nothing behind.
_CONTAINERS: weakref.WeakSet[Experts] = weakref.WeakSet()


def expert_containers() -> Iterator[Experts]:
    return iter(list(_CONTAINERS))


class Experts(nn.Module):
    """`num_local_experts` copies of `expert`. `forward` takes DeepSpeed's `[ep, E_local, C, M]`
    capacity buffer and runs local expert l on `[:, l]`; `forward_rows` runs each expert on its
    own row block (dropless mode)."""

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
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = [_first(expert(chunk)) for chunk, expert in zip(chunks, self.deepspeed_experts)]
        return torch.cat(outputs, dim=1)

    def forward_rows(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """`rows` grouped by local expert (`rows_per_expert[l]` rows for expert l, in order).
        Every expert runs, even on zero rows, so each rank calls every expert module on every step."""
        blocks = rows.split(rows_per_expert, dim=0)
        outputs = [_first(expert(block)) for block, expert in zip(blocks, self.deepspeed_experts)]
        return torch.cat(outputs, dim=0)


def _first(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    # DeepSpeed allows an expert to return (output, bias); the bias is ignored, as there.
    return output[0] if isinstance(output, tuple) else output
