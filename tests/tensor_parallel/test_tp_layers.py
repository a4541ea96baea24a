"""Tensor-parallel operators, layers and vocab-parallel cross entropy against one-process math."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodist.comm as comm
from zerodist.comm.domains import parameter_placements
from zerodist.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorRegion,
    UnevenSplitError,
    VocabParallelEmbedding,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
    unslice_tensor,
    vocab_parallel_cross_entropy,
)
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _region(world_size):
    return TensorRegion.of(comm.Topology(tensor=world_size))


def _grad_from(x, fn, upstream):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.backward(upstream)
    return out.detach(), x.grad


@distributed_test(world_size=[2, 4])
def test_conjugate_operators_forward_and_backward_by_hand(world_size):
    region = _region(world_size)
    r, t = region.rank, world_size
    torch.manual_seed(0)
    x = torch.randn(2, 4 * t, 3 * t, dtype=torch.float64)  # the same on every rank
    per_rank = [torch.randn(2, 4 * t, 3 * t, dtype=torch.float64) for _ in range(t)]  # rank i's own values
    mine = per_rank[r]

    out, grad = _grad_from(x, lambda v: copy_to_tensor_region(v, region), mine)
    assert torch.equal(out, x) and torch.allclose(grad, sum(per_rank), rtol=0, atol=1e-12)

    out, grad = _grad_from(mine, lambda v: reduce_from_tensor_region(v, region), x)
    assert torch.allclose(out, sum(per_rank), rtol=0, atol=1e-12) and torch.equal(grad, x)

    local = mine[..., : 3]
    out, grad = _grad_from(local, lambda v: gather_from_tensor_region(v, region), x)
    assert torch.equal(out, torch.cat([p[..., :3] for p in per_rank], dim=-1))
    assert torch.equal(grad, x[..., 3 * r: 3 * r + 3])

    out, grad = _grad_from(x, lambda v: scatter_to_tensor_region(v, region), mine[..., :3])
    assert torch.equal(out, x[..., 3 * r: 3 * r + 3])
    assert torch.equal(grad, torch.cat([p[..., :3] for p in per_rank], dim=-1))

    out, grad = _grad_from(mine[:, :4], lambda v: gather_from_sequence_region(v, region), x)
    assert torch.equal(out, torch.cat([p[:, :4] for p in per_rank], dim=1))
    assert torch.allclose(grad, t * x[:, 4 * r: 4 * r + 4], rtol=0, atol=1e-12)  # every rank sent x

    out, grad = _grad_from(mine, lambda v: reduce_scatter_to_sequence_region(v, region), x[:, :4])
    assert torch.allclose(out, sum(per_rank)[:, 4 * r: 4 * r + 4], rtol=0, atol=1e-12)
    assert torch.equal(grad, x[:, :4].repeat(1, t, 1))

    out, grad = _grad_from(x, lambda v: scatter_to_sequence_region(v, region), mine[:, :4])
    assert torch.equal(out, x[:, 4 * r: 4 * r + 4])
    assert torch.equal(grad, torch.cat([p[:, :4] for p in per_rank], dim=1))

    with pytest.raises(UnevenSplitError, match="does not split evenly into"):
        scatter_to_tensor_region(torch.zeros(3, 2 * t + 1), region)


def _mlp_reference_and_parallel(region, dtype, seed, sequence_parallel):
    torch.manual_seed(seed)
    fc_in, fc_out = nn.Linear(8, 16, dtype=dtype), nn.Linear(16, 8, dtype=dtype)
    torch.manual_seed(seed)
    col = ColumnParallelLinear(8, 16, region=region, dtype=dtype, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(16, 8, region=region, dtype=dtype, sequence_parallel=sequence_parallel)
    return (fc_in, fc_out), (col, row)


@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_then_row_parallel_mlp_matches_one_process(world_size, dtype, sequence_parallel):
    region = _region(world_size)
    (fc_in, fc_out), (col, row) = _mlp_reference_and_parallel(region, dtype, 3, sequence_parallel)
    # Degree-independent init: each slice is bitwise the matching slice of the plain weight.
    assert torch.equal(unslice_tensor(col.weight, col.weight_spec, region), fc_in.weight)
    assert torch.equal(unslice_tensor(row.weight, row.weight_spec, region), fc_out.weight)
    assert torch.equal(row.bias, fc_out.bias)

    torch.manual_seed(11)
    x = torch.randn(3, 4 * world_size, 8, dtype=dtype, requires_grad=True)
    upstream = torch.randn(3, 4 * world_size, 8, dtype=dtype)
    expected = fc_out(F.gelu(fc_in(x)))
    expected.backward(upstream)

    seq = slice(4 * region.rank, 4 * region.rank + 4)
    x_tp = (x.detach()[:, seq] if sequence_parallel else x.detach()).clone().requires_grad_(True)
    out = row(F.gelu(col(x_tp)))
    out.backward(upstream[:, seq] if sequence_parallel else upstream)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected.detach()[:, seq] if sequence_parallel else expected.detach(), **tol)
    torch.testing.assert_close(x_tp.grad, x.grad[:, seq] if sequence_parallel else x.grad, **tol)
    torch.testing.assert_close(unslice_tensor(col.weight.grad, col.weight_spec, region), fc_in.weight.grad, **tol)
    torch.testing.assert_close(unslice_tensor(col.bias.grad, col.weight_spec, region), fc_in.bias.grad, **tol)
    torch.testing.assert_close(unslice_tensor(row.weight.grad, row.weight_spec, region), fc_out.weight.grad, **tol)
    row_bias_grad = row.bias.grad.clone()
    if sequence_parallel:  # partial over the sequence shards: summed over the tensor axis
        comm.all_reduce(row_bias_grad, group=region.group)
    torch.testing.assert_close(row_bias_grad, fc_out.bias.grad, **tol)

    placements = parameter_placements(nn.ModuleList([col, row]))
    assert placements[id(col.weight)].slice_dim == 0 and placements[id(row.weight)].slice_dim == 1
    assert "tensor" not in placements[id(col.bias)].domain.replicated_axes
    assert ("tensor" in placements[id(row.bias)].domain.reduce_axes) == sequence_parallel


@distributed_test(world_size=[2, 4])
def test_fused_column_slices_each_sub_parameter(world_size):
    region = _region(world_size)
    torch.manual_seed(5)
    qkv = nn.Linear(4, 3 * 4 * world_size, dtype=torch.float64)
    col = ColumnParallelLinear.from_linear(qkv, region, fused=(4 * world_size,) * 3)
    local_q, local_k, local_v = col.weight.chunk(3)
    for sub, local in zip(qkv.weight.chunk(3), (local_q, local_k, local_v)):
        assert torch.equal(local, sub[4 * region.rank: 4 * region.rank + 4])
    assert torch.equal(unslice_tensor(col.weight, col.weight_spec, region), qkv.weight)
    with pytest.raises(ValueError, match="sum to"):
        ColumnParallelLinear.from_linear(qkv, region, fused=(1, 2))


@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_pads_and_matches(world_size, sequence_parallel):
    region = _region(world_size)
    vocab = 4 * world_size + 1  # not divisible: padded with zero rows
    torch.manual_seed(2)
    reference = nn.Embedding(vocab, 6, dtype=torch.float64)
    torch.manual_seed(2)
    layer = VocabParallelEmbedding(vocab, 6, region=region, sequence_parallel=sequence_parallel, dtype=torch.float64)
    assert torch.equal(unslice_tensor(layer.weight, layer.weight_spec, region), reference.weight)
    assert layer.weight.shape[0] * world_size == 4 * world_size + world_size

    ids = torch.randint(0, vocab, (2, 2 * world_size), generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(2, 2 * world_size, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = reference(ids)
    expected.backward(upstream)
    out = layer(ids)
    seq = slice(2 * region.rank, 2 * region.rank + 2) if sequence_parallel else slice(None)
    out.backward(upstream[:, seq])
    torch.testing.assert_close(out, expected.detach()[:, seq], rtol=0, atol=1e-12)
    # Complete on each rank, with or without sequence parallelism: the backward of the
    # reduce-scatter all-gathers the upstream gradient of every position.
    torch.testing.assert_close(unslice_tensor(layer.weight.grad, layer.weight_spec, region), reference.weight.grad,
                               rtol=1e-12, atol=1e-12)


@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(world_size, dtype):
    region = _region(world_size)
    vocab = 8 * world_size
    generator = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(5, 6, vocab, dtype=dtype, generator=generator)).requires_grad_(True)
    target = torch.randint(0, vocab, (5, 6), generator=generator)
    target[0, :3] = -100
    expected = F.cross_entropy(logits.view(-1, vocab), target.view(-1))
    expected.backward()
    width = vocab // world_size
    local = logits.detach()[..., region.rank * width: (region.rank + 1) * width].clone().requires_grad_(True)
    with comm.trace() as recorded:
        loss = vocab_parallel_cross_entropy(local, target, region)
    loss.backward()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(loss, expected.detach(), **tol)
    torch.testing.assert_close(local.grad, logits.grad[..., region.rank * width: (region.rank + 1) * width], **tol)
    # Three all-reduces of one value per token, never the logits.
    assert recorded.count("all_reduce") == 3 and recorded.total_numel() == 3 * 5 * 6
    none = vocab_parallel_cross_entropy(local.detach(), target, region, reduction="none")
    torch.testing.assert_close(none, F.cross_entropy(logits.detach().view(-1, vocab), target.view(-1),
                                                     reduction="none").view(5, 6), **tol)


@distributed_test(world_size=[2, 4])
def test_gathered_column_layer_pads_an_uneven_output(world_size):
    region = _region(world_size)
    out = 4 * world_size + 1  # an LM head over a vocabulary t does not divide
    torch.manual_seed(4)
    reference = nn.Linear(8, out, dtype=torch.float64)
    layer = ColumnParallelLinear.from_linear(reference, region, gather_output=True)
    assert layer.weight.shape[0] * world_size == out + world_size - 1
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(3, out, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = reference(x)
    expected.backward(upstream)
    got = layer(x)
    got.backward(upstream)
    torch.testing.assert_close(got, expected.detach(), **TOLERANCE[torch.float64])
    torch.testing.assert_close(unslice_tensor(layer.weight.grad, layer.weight_spec, region), reference.weight.grad,
                               **TOLERANCE[torch.float64])
    with pytest.raises(UnevenSplitError, match="does not split evenly"):
        ColumnParallelLinear.from_linear(reference, region)  # an output kept split must divide
