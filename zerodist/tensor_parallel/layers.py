"""Column-parallel and row-parallel linears and the vocab-parallel embedding.

Shapes (t = tensor-parallel degree):
- `ColumnParallelLinear(in, out)`: weight `[out/t, in]` (the output features are split), bias
  `[out/t]`. Input replicated (or, under sequence parallelism, split along the sequence), output
  split along the last dim unless `gather_output` (then `out` need not divide by t: the weight is
  padded with zero rows and the gathered output narrowed back).
- `RowParallelLinear(in, out)`: weight `[out, in/t]` (the input features are split), bias `[out]`
  whole and added once, after the reduction. Input split along the last dim, output replicated
  (or reduce-scattered along the sequence under sequence parallelism).
- `VocabParallelEmbedding(V, h)`: weight `[ceil(V/t)... padded/t, h]` (rows split; the vocabulary
  is padded with zero rows to a multiple of t, and no token id ever reaches the padding).

[Note: degree-independent init] A layer built directly draws the *full* weight with the same
calls, in the same order, as `nn.Linear` / `nn.Embedding` would (from the global generator), then
keeps its slice: with the same seed, every slice equals the matching slice of the unparallelized
layer's weight, at any degree, and the global generator advances identically on every rank.

A fused weight (QKV `[3h, in]`, gate/up `[2f, in]`) names its sub-parameter sizes (`fused`): each
sub-parameter is split on its own and the local weight is the concatenation of the local parts
(`[q_r; k_r; v_r]`), so a head-sliced attention sees its q, k and v heads side by side.

The parameters are named `weight` and `bias` as in `nn.Linear` / `nn.Embedding`, so a model whose
layers are swapped keeps its `state_dict()` keys. Placements are declared in the side table of
`zerodist.comm.domains`; nothing is set on user objects.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zerodist.comm.domains import Placement, declare_placement
from zerodist.comm.slices import SliceSpec, cut_slice, join_slices
from zerodist.comm.topology import DENSE, PARAMETER_AXES, TENSOR_SLICE, Domain
from zerodist.tensor_parallel import operators as ops
from zerodist.tensor_parallel import schedule
from zerodist.tensor_parallel.chunks import chunk_turn
from zerodist.tensor_parallel.operators import TensorRegion, check_divisible
from zerodist.tensor_parallel.shared_input import SharedGroup, SharedInput

# A replicated parameter whose gradient is partial across tensor ranks (a norm or row-parallel
# bias applied to sequence shards): summed over the tensor axis as well as the batch axes.
SEQUENCE_PARTIAL = Domain(DENSE.reduce_axes + ("tensor",), PARAMETER_AXES)


def slice_tensor(full: torch.Tensor, spec: SliceSpec, region: TensorRegion) -> torch.Tensor:
    """This rank's slice of the logical tensor `full` (pads first when `spec.padded_size`)."""
    for length in spec.fused or (spec.padded_size or full.shape[spec.dim],):
        check_divisible(length, region.size, f"dimension {spec.dim} of a {tuple(full.shape)} tensor")
    return cut_slice(full, spec, region.rank, region.size)


def unslice_tensor(local: torch.Tensor, spec: SliceSpec, region: TensorRegion) -> torch.Tensor:
    """The logical tensor from every rank's slice (all-gather; the inverse of `slice_tensor`)."""
    return join_slices(ops.all_gather_dim(local.detach(), spec.dim, region), spec, region.size)


def _check_fused(length: int, fused: tuple[int, ...], region: TensorRegion, what: str) -> None:
    if fused and sum(fused) != length:
        raise ValueError(f"{what}: fused sub-parameter sizes {fused} sum to {sum(fused)}, not {length}")
    for size in fused or (length,):
        check_divisible(size, region.size, f"{what} (split over tensor={region.size})")


def _linear_init(out_features: int, in_features: int, bias: bool, dtype: torch.dtype | None):
    """The full weight and bias exactly as `nn.Linear.reset_parameters` draws them."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight, torch.empty(out_features, dtype=dtype).uniform_(-bound, bound)


class _ColumnLinearFunction(torch.autograd.Function):
    """`x @ w.T + b` whose backward issues the input-gradient reduction (all-reduce, or
    reduce-scatter under sequence parallelism) *before* the weight-gradient matmul and waits
    after it, so the collective runs under that matmul (Megatron's async grad all-reduce).
    With a `group` the input is a `SharedInput`'s copy read by several layers: the input gradient
    goes to the group, and the group's last layer reduces the group's sum instead, under its own
    weight-gradient matmul (`shared_input.py`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, region: TensorRegion, sequence_dim, group: SharedGroup | None = None):
        if sequence_dim is not None:
            # Sequence parallelism: the input arrives split along the sequence; the full one is
            # kept for the weight gradient (no re-gather in backward).
            x = ops.all_gather_dim(x, sequence_dim, region)
        ctx.save_for_backward(x, weight)
        ctx.region, ctx.sequence_dim, ctx.has_bias = region, sequence_dim, bias is not None
        ctx.group = group
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_input = grad_out.matmul(weight)
        group: SharedGroup | None = ctx.group
        if group is not None:
            group.arrived += 1
            if group.arrived < group.users:  # not the group's last: the last sums and reduces
                group.partials.append(grad_input)
                return (None,) + _weight_gradients(ctx, grad_out, x) + (None, None, None)
            for partial in group.partials:
                grad_input.add_(partial)
            group.partials, group.arrived = [], 0
        if ctx.region.size == 1:
            handle = None
        elif group is not None and group.sequence_dim is not None:
            grad_input, handle = ops.reduce_scatter_dim(grad_input, group.sequence_dim, ctx.region, async_op=True)
        elif ctx.sequence_dim is None:
            handle = ops.all_reduce_(grad_input, ctx.region, async_op=True)
        else:
            grad_input, handle = ops.reduce_scatter_dim(grad_input, ctx.sequence_dim, ctx.region, async_op=True)
        # The payload: the full input gradient (x is the gathered input under sequence parallelism).
        logged = schedule.log_issue("backward", x.numel() * x.element_size()) if handle is not None else -1
        grad_weight, grad_bias = _weight_gradients(ctx, grad_out, x)
        if handle is not None:
            if logged >= 0:
                schedule.log_compute("backward", "weight gradient")
            schedule.wait(handle, logged, "backward")
        if group is not None:  # the copy's backward hands it on
            group.reduced = grad_input
            return None, grad_weight, grad_bias, None, None, None
        return grad_input, grad_weight, grad_bias, None, None, None


def _weight_gradients(ctx, grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    grad_weight = flat_grad.t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_weight, (flat_grad.sum(0) if ctx.has_bias else None)


def column_linear(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  sequence_parallel: bool) -> torch.Tensor:
    """`x @ weight.T + bias` for a column-parallel layer: through its `SharedInput` when it has one
    and is inside that scope (the input copied, or gathered, once for every layer reading it),
    else with its own input-gradient reduction (and, under sequence parallelism, its own gather)."""
    region: TensorRegion = layer.region  # type: ignore[assignment]
    shared: SharedInput | None = layer.shared_input  # type: ignore[assignment]
    prepared = shared.prepare(x) if shared is not None and region.size > 1 else None
    if prepared is not None:
        return _ColumnLinearFunction.apply(prepared[0], weight, bias, region, None, prepared[1])
    sequence_dim = x.dim() - 2 if sequence_parallel and region.size > 1 else None
    return _ColumnLinearFunction.apply(x, weight, bias, region, sequence_dim, None)


def chunk_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """[Note: Domino at ZeRO-3] A row-parallel layer's bias, to add after its reduction: inside a
    Domino chunk that reduction may be waited in the next block, after ZeRO-3 released this
    block's parameters, so the chunk adds a copy taken now, while they are gathered (the same
    values; the gradient reaches the bias through the copy)."""
    return bias * 1 if bias is not None and chunk_turn() is not None else bias


def row_reduce(partial: torch.Tensor, region: TensorRegion) -> torch.Tensor:
    """A row-parallel layer's partial product summed over the tensor axis, in place (the layer
    made it): inside a Domino chunk, asynchronously, the other chunks computing meanwhile."""
    turn = chunk_turn()
    if turn is not None:
        return turn.reduce(partial, region)
    return ops.reduce_from_tensor_region_(partial, region)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by output columns over the tensor axis (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, *, region: TensorRegion, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, fused: tuple[int, ...] = (),
                 dtype: torch.dtype | None = None):
        super().__init__()
        full_weight, full_bias = _linear_init(out_features, in_features, bias, dtype)
        self._setup(full_weight, full_bias, region, gather_output, sequence_parallel, tuple(fused))

    @classmethod
    def from_linear(cls, linear: nn.Linear, region: TensorRegion, *, gather_output: bool = False,
                    sequence_parallel: bool = False, fused: tuple[int, ...] = ()) -> ColumnParallelLinear:
        """The column-parallel layer holding this rank's slice of `linear`'s weights."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        bias = None if linear.bias is None else linear.bias.detach()
        layer._setup(linear.weight.detach(), bias, region, gather_output, sequence_parallel, tuple(fused))
        return layer

    def _setup(self, weight, bias, region, gather_output, sequence_parallel, fused) -> None:
        out_features, in_features = weight.shape
        padded = None
        if gather_output and not fused and out_features % region.size:
            # A gathered output (an LM head over a vocabulary t does not divide) is padded with
            # zero rows to a multiple of t and narrowed back after the gather.
            padded = -(-out_features // region.size) * region.size
        else:
            _check_fused(out_features, fused, region, f"ColumnParallelLinear output features ({out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.region, self.gather_output, self.sequence_parallel = region, gather_output, sequence_parallel
        # Set by `parallelize` for a layer inside a module the plan prepares (`PrepareInput`).
        self.shared_input: SharedInput | None = None
        self.weight_spec = SliceSpec(0, out_features, fused, padded_size=padded)
        self.weight = nn.Parameter(slice_tensor(weight, self.weight_spec, region))
        self.bias = None if bias is None else nn.Parameter(slice_tensor(bias, self.weight_spec, region))
        declare_placement(self, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor", fused=fused,
                                          logical_size=out_features if padded else None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_linear(self, x, self.weight, self.bias, self.sequence_parallel)
        if not self.gather_output:
            return y
        gathered = ops.gather_from_tensor_region(y, self.region)
        return gathered if gathered.shape[-1] == self.out_features else gathered[..., : self.out_features]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), tensor={self.region.size}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by input rows; the partial products are summed over the tensor
    axis (all-reduce, or reduce-scatter along the sequence under sequence parallelism), then the
    whole bias is added once."""

    def __init__(self, in_features: int, out_features: int, *, region: TensorRegion, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        full_weight, full_bias = _linear_init(out_features, in_features, bias, dtype)
        self._setup(full_weight, full_bias, region, input_is_parallel, sequence_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, region: TensorRegion, *, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        bias = None if linear.bias is None else linear.bias.detach()
        layer._setup(linear.weight.detach(), bias, region, input_is_parallel, sequence_parallel)
        return layer

    def _setup(self, weight, bias, region, input_is_parallel, sequence_parallel) -> None:
        out_features, in_features = weight.shape
        _check_fused(in_features, (), region, f"RowParallelLinear input features ({in_features})")
        self.in_features, self.out_features = in_features, out_features
        self.region, self.input_is_parallel, self.sequence_parallel = region, input_is_parallel, sequence_parallel
        self.weight_spec = SliceSpec(1, in_features)
        self.weight = nn.Parameter(slice_tensor(weight, self.weight_spec, region))
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        declare_placement(self, Placement(TENSOR_SLICE, slice_dim=1, slice_axis="tensor"), names=["weight"])
        if self.bias is not None and sequence_parallel:
            declare_placement(self, SEQUENCE_PARTIAL, names=["bias"])

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the reduction and without the bias (Domino)."""
        if not self.input_is_parallel:
            x = ops.scatter_to_tensor_region(x, self.region)
        return F.linear(x, self.weight)

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced if self.bias is None else reduced + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.partial(x)
        if self.sequence_parallel:
            return self.add_bias(ops.reduce_scatter_to_sequence_region(partial, self.region))
        bias = chunk_bias(self.bias)
        reduced = row_reduce(partial, self.region)
        return reduced if bias is None else reduced + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"tensor={self.region.size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the tensor axis. Each rank looks up the
    ids it owns (others give zero rows) and the partial lookups are summed (all-reduce, or
    reduce-scatter along the sequence under sequence parallelism)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, region: TensorRegion,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
        nn.init.normal_(weight)  # nn.Embedding.reset_parameters, padding_idx=None
        self._setup(weight, region, sequence_parallel)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, region: TensorRegion, *,
                       sequence_parallel: bool = False) -> VocabParallelEmbedding:
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings only "
                             "(no padding_idx, max_norm or sparse gradients)")
        if type(embedding).forward is not nn.Embedding.forward:  # e.g. Gemma's, which scales the rows it looks up
            raise ValueError(f"VocabParallelEmbedding replaces plain embeddings only; {type(embedding).__name__} has "
                             "a forward of its own, which the vocab-parallel lookup would drop: leave it out of the "
                             "plan (replicated over the tensor axis)")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(embedding.weight.detach(), region, sequence_parallel)
        return layer

    def _setup(self, weight: torch.Tensor, region: TensorRegion, sequence_parallel: bool) -> None:
        num_embeddings, embedding_dim = weight.shape
        padded = -(-num_embeddings // region.size) * region.size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.region, self.sequence_parallel = region, sequence_parallel
        self.weight_spec = SliceSpec(0, num_embeddings, padded_size=padded)
        self.num_local = padded // region.size
        self.vocab_start = region.rank * self.num_local
        self.weight = nn.Parameter(slice_tensor(weight, self.weight_spec, region))
        declare_placement(self, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor",
                                          logical_size=num_embeddings if padded != num_embeddings else None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.region.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.num_local)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sequence_region(partial, self.region)
        return ops.reduce_from_tensor_region_(partial, self.region)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local rows {self.vocab_start}.."
                f"{self.vocab_start + self.num_local}, tensor={self.region.size}")


class TiedVocabParallelHead(ColumnParallelLinear):
    """An LM head tied to a `VocabParallelEmbedding`: its `weight` *is* the embedding's parameter
    (this rank's rows of the padded vocabulary), so the tie survives tensor parallelism and both
    uses' gradients land on the one slice. Logits are gathered over the tensor axis and narrowed
    to the vocabulary, so a loss written for full logits (Hugging Face's `labels=...`) runs as is.
    Declares nothing: the embedding's placement covers the shared parameter."""

    def __init__(self, embedding: VocabParallelEmbedding, *, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.region, self.gather_output, self.sequence_parallel = embedding.region, True, sequence_parallel
        self.shared_input = None
        self.weight_spec = embedding.weight_spec
        self.weight = embedding.weight
        self.bias = None
