"""The loss every rank should log: the mean over ranks, weighted by tokens when they differ.

Each rank computes its loss on its own micro-batch, so logging rank 0's loss reports one
shard of the data, and averaging per-rank means is wrong when ranks see different numbers
of tokens (padding, packing, variable-length batches): a rank with 10 tokens would weigh as
much as one with 1,000. `reduce_loss` returns the loss of the global batch:

    sum_i(loss_i * n_i) / sum_i(n_i)      with num_tokens=n_i (losses are per-token means)
    sum_i(loss_i) / N                     without

Invalid input on any rank (a non-scalar loss, negative counts, some ranks passing
`num_tokens` and others not) is reported on every rank, since a rank that raised alone
would leave the others waiting in the all_reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodist import comm
from zerodist.comm import Group

# Slots of the one all_reduced vector: weighted loss, weight, ranks passing num_tokens, bad ranks.
_LOSS, _WEIGHT, _WITH_TOKENS, _BAD = range(4)


def reduce_loss(loss: torch.Tensor, *, num_tokens: int | float | torch.Tensor | None = None,
                group: Group = None) -> torch.Tensor:
    """The mean of `loss` over the ranks of `group`, token-weighted when `num_tokens` is given.

    `loss` is this rank's scalar loss (a per-token mean when `num_tokens` is given). Returns a
    detached scalar on `loss`'s device, float32 (float64 if the loss is float64). Works in a
    one-process world. Collective: call it on every rank of `group`.
    """
    problem = _problem(loss, num_tokens)
    dtype = torch.float64  # the weighted sum of many ranks' losses, kept exact enough to compare
    device = loss.device if isinstance(loss, torch.Tensor) else comm.device_for_rank()
    vector = torch.zeros(4, dtype=dtype, device=device)
    if problem is None:
        weight = 1.0 if num_tokens is None else float(num_tokens)
        vector[_LOSS] = loss.detach().to(dtype).reshape(()) * weight
        vector[_WEIGHT] = weight
        vector[_WITH_TOKENS] = 0.0 if num_tokens is None else 1.0
    else:
        vector[_BAD] = 1.0
    comm.all_reduce(vector, group=group)
    size = comm.get_world_size(group)
    totals = vector.tolist()
    if problem is not None or totals[_BAD] > 0:
        raise ValueError(
            f"reduce_loss: {int(totals[_BAD])} of {size} rank(s) passed invalid input; "
            f"this rank (rank {comm.get_rank()}): {problem or 'ok'}"
        )
    if totals[_WITH_TOKENS] not in (0.0, float(size)):
        raise ValueError(
            f"reduce_loss: {int(totals[_WITH_TOKENS])} of {size} rank(s) passed num_tokens and the others did not; "
            "pass it on every rank (0 for a rank without tokens) or on none"
        )
    if totals[_WEIGHT] <= 0:
        raise ValueError(f"reduce_loss: the ranks' num_tokens sum to {totals[_WEIGHT]:g}; nothing to average over")
    result_dtype = torch.float64 if loss.dtype == torch.float64 else torch.float32  # bf16 would round the mean
    return (vector[_LOSS] / vector[_WEIGHT]).to(result_dtype)


def _problem(loss: Any, num_tokens: Any) -> str | None:
    """What is wrong with this rank's input, or None."""
    if not isinstance(loss, torch.Tensor):
        return f"loss must be a tensor, got {type(loss).__name__}"
    if loss.numel() != 1:
        return f"loss must be a scalar, got shape {tuple(loss.shape)} (reduce it to a mean first)"
    if not loss.is_floating_point():
        return f"loss must be floating point, got {loss.dtype}"
    if num_tokens is None:
        return None
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            return f"num_tokens must be a scalar, got shape {tuple(num_tokens.shape)}"
        num_tokens = num_tokens.item()
    if not isinstance(num_tokens, (int, float)) or isinstance(num_tokens, bool):
        return f"num_tokens must be a number, got {type(num_tokens).__name__}"
    if num_tokens < 0:
        return f"num_tokens must be >= 0, got {num_tokens}"
    return None
