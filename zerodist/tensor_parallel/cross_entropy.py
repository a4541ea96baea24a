"""Cross entropy over logits whose vocabulary is split across the tensor axis.

The full logits are never gathered: the forward issues three all-reduces of one value per token
(the max, the target's logit, which only its owning rank holds, and the sum of exponentials), so
the traffic is 3 x T elements instead of T x V. The backward is local:
`softmax - one_hot(target)` on the owning rank, `softmax` elsewhere, times the incoming gradient.
"""

from __future__ import annotations

import torch

from zerodist import comm
from zerodist.tensor_parallel.operators import TensorRegion


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, region: TensorRegion, ignore_index: int):
        num_local = logits.shape[-1]
        vocab_start = region.rank * num_local
        logits_max = logits.detach().amax(dim=-1)
        comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=region.group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < vocab_start) | (target >= vocab_start + num_local) | ignored
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group=region.group)

        exp_logits = shifted.exp()
        sum_exp = exp_logits.sum(dim=-1)
        comm.all_reduce(sum_exp, group=region.group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        owned = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, region: TensorRegion, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits.view(-1, V), target.view(-1))` from this rank's vocabulary
    slice `logits` (`[..., V/t]`, rank r holding ids `r*V/t .. (r+1)*V/t - 1`).

    `reduction` is "mean" (over the targets that are not `ignore_index`), "sum" or "none"
    (per-token losses, the shape of `target`). Padded vocabulary columns must hold a very
    negative logit (they are counted in the softmax like any other column)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: the logits "
                         "must be the target's shape plus a last (vocabulary slice) dimension")
    losses = _VocabParallelCrossEntropy.apply(logits, target.long(), region, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
