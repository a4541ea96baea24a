"""The token-weighted loss over the whole sequence.

Each sequence rank's model computes the mean loss over its own labelled tokens (labels -100
ignored). The loss of the sample is the mean over all its labelled tokens:
    L = sum_r n_r L_r / sum_r n_r        (n_r: labelled tokens on rank r)
`token_weighted_mean` returns L on every sequence rank (one all-reduce of two numbers), with the
gradient of this rank's share only: dL/dL_r = n_r / n. Summed over the sequence ranks, as the
gradient reduction over data x sequence does, the shares give the gradient of L, once: the
divisor stays the number of batch shards (data x expert), never x P ([Note: sequence gradients]).

[Note: sequence gradients] The sequence ranks of one sample each back-propagate their share of one
loss; the all-to-alls' backwards carry every share's gradient to the ranks whose activations
produced it, so rank r's parameter gradient is its part of dL/dθ and the sum over sequence ranks
is dL/dθ. The data ranks hold different samples, each a loss of its own, averaged: divide by
data x expert. Dividing by data x sequence (what an "average over the reduce group" would do) makes
gradients P times too small; a loss that is the full mean on every rank, each back-propagating
all of it, makes them P times too large (DeepSpeed #5248).
"""

from __future__ import annotations

from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.sequence.data import IGNORE_INDEX


class _TokenWeightedMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, count: torch.Tensor, group: Group) -> torch.Tensor:
        count = count.detach().to(torch.float64)
        # a rank with no labelled token contributes nothing (its mean is 0/0)
        share = loss.detach().to(torch.float64) * count if count > 0 else torch.zeros((), dtype=torch.float64, device=loss.device)
        both = torch.stack([share, count])
        comm.all_reduce(both, group=group)
        total = float(both[1])
        ctx.weight = float(count) / total if total > 0 else 0.0
        value = both[0] / total if total > 0 else both[0]
        return value.to(loss.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return grads[0] * ctx.weight, None, None


def token_weighted_mean(loss: torch.Tensor, labels: torch.Tensor, group: Group) -> torch.Tensor:
    """The whole sequence's mean token loss from this rank's `loss` (mean over its labelled tokens
    of `labels`); its gradient is this rank's share (see the module's docstring)."""
    count = (labels != IGNORE_INDEX).sum()
    return _TokenWeightedMean.apply(loss, count, group)
