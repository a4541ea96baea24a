"""Column- and row-parallel versions of Hugging Face's `Conv1D` (GPT-2, GPT-1, ...).

`transformers.pytorch_utils.Conv1D(nf, nx)` is a linear layer whose weight is stored transposed:
`weight` is `[in, out]` (`nx` x `nf`), `bias` `[out]`, and `y = x @ weight + bias`. So, with t the
tensor-parallel degree:

- `ColumnParallelConv1D`: the output features are split, which is *dim 1* of the weight:
  weight `[in, out/t]`, bias `[out/t]` (dim 0). Fused outputs (GPT-2's `c_attn` is `[q | k | v]`
  along the output) name their sub-parameters (`fused`), each split on its own, so the local
  weight is `[q_r | k_r | v_r]` and a head-sliced attention sees its q, k and v heads side by side.
- `RowParallelConv1D`: the input features are split, which is *dim 0*: weight `[in/t, out]`; the
  partial products are summed over the tensor axis, then the whole bias `[out]` is added once.

The parameters keep the names and the layout of `Conv1D` (`weight` `[in, *]`, `bias`), so the
model's `state_dict()` keys do not change and the unsliced tensors have `Conv1D`'s shapes. The
slices' placements (slice dim 1 for a column weight, 0 for its bias and for a row weight) are
declared in `zerodist.comm.domains`, which is what ZeRO and checkpoints read. transformers is not
imported: any module with a `[in, out]` `weight` and an `[out]` `bias` converts.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodist.comm.domains import Placement, declare_placement
from zerodist.comm.topology import TENSOR_SLICE
from zerodist.tensor_parallel import operators as ops
from zerodist.tensor_parallel.layers import (
    SEQUENCE_PARTIAL,
    SliceSpec,
    _check_fused,
    column_linear,
    chunk_bias,
    row_reduce,
    slice_tensor,
)
from zerodist.tensor_parallel.shared_input import SharedInput
from zerodist.tensor_parallel.operators import TensorRegion


def _conv1d_tensors(conv: nn.Module, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = getattr(conv, "weight", None), getattr(conv, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or (
            bias is not None and tuple(bias.shape) != (weight.shape[1],)):
        raise ValueError(f"{what} converts a Conv1D-like module (weight [in, out], bias [out]); got "
                         f"{type(conv).__name__} with weight {tuple(getattr(weight, 'shape', ()))}")
    return weight.detach(), None if bias is None else bias.detach()


class ColumnParallelConv1D(nn.Module):
    """`Conv1D` with its output features split over the tensor axis: input replicated, output
    split along the last dim. Its backward all-reduces the input gradient (issued before the
    weight-gradient matmul, as `ColumnParallelLinear`)."""

    def __init__(self, conv: nn.Module, region: TensorRegion, *, fused: tuple[int, ...] = (),
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel  # input split along the sequence: gathered first
        weight, bias = _conv1d_tensors(conv, "ColumnParallelConv1D")
        in_features, out_features = weight.shape
        fused = tuple(fused)
        _check_fused(out_features, fused, region, f"ColumnParallelConv1D output features ({out_features})")
        self.in_features, self.out_features, self.region, self.fused = in_features, out_features, region, fused
        self.shared_input: SharedInput | None = None  # set by `parallelize` inside a `PrepareInput` module
        self.weight_spec = SliceSpec(1, out_features, fused)
        self.bias_spec = SliceSpec(0, out_features, fused)
        self.weight = nn.Parameter(slice_tensor(weight, self.weight_spec, region))
        self.bias = None if bias is None else nn.Parameter(slice_tensor(bias, self.bias_spec, region))
        declare_placement(self, Placement(TENSOR_SLICE, slice_dim=1, slice_axis="tensor", fused=fused),
                          names=["weight"])
        if self.bias is not None:
            declare_placement(self, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor", fused=fused),
                              names=["bias"])

    def slice_specs(self) -> dict[str, SliceSpec]:
        """The sliced parameters (local names) and how each was cut from its logical tensor."""
        return {"weight": self.weight_spec} if self.bias is None else {"weight": self.weight_spec,
                                                                       "bias": self.bias_spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x @ W is F.linear(x, W.T): the transpose is a view, its gradient flows back to W.
        return column_linear(self, x, self.weight.t(), self.bias, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[1]}), fused={self.fused or None}, tensor={self.region.size}")


class RowParallelConv1D(nn.Module):
    """`Conv1D` with its input features split over the tensor axis: input split along the last
    dim, partial products all-reduced, the whole bias added once after the reduction."""

    def __init__(self, conv: nn.Module, region: TensorRegion, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel  # output reduce-scattered along the sequence
        weight, bias = _conv1d_tensors(conv, "RowParallelConv1D")
        in_features, out_features = weight.shape
        _check_fused(in_features, (), region, f"RowParallelConv1D input features ({in_features})")
        self.in_features, self.out_features, self.region = in_features, out_features, region
        self.weight_spec = SliceSpec(0, in_features)
        self.weight = nn.Parameter(slice_tensor(weight, self.weight_spec, region))
        self.bias = None if bias is None else nn.Parameter(bias.clone())  # replicated: DENSE, undeclared
        declare_placement(self, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor"), names=["weight"])
        if self.bias is not None and sequence_parallel:  # added to this rank's slice of the sequence only
            declare_placement(self, SEQUENCE_PARTIAL, names=["bias"])

    def slice_specs(self) -> dict[str, SliceSpec]:
        return {"weight": self.weight_spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.matmul(x, self.weight)
        if self.sequence_parallel:
            reduced = ops.reduce_scatter_to_sequence_region(partial, self.region)
            return reduced if self.bias is None else reduced + self.bias
        bias = chunk_bias(self.bias)  # [Note: Domino at ZeRO-3] in layers.py
        reduced = row_reduce(partial, self.region)
        return reduced if bias is None else reduced + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[0]}), out_features={self.out_features}, "
                f"tensor={self.region.size}")
