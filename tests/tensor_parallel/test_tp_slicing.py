"""The local-to-logical element arithmetic that checkpoints of tensor-parallel slices use."""

import pytest
import torch

from zerodist.comm.slices import ParamSlicing
from zerodist.tensor_parallel import SliceSpec, TensorRegion, slice_tensor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec, shape", [
    (SliceSpec(0, 12), (12, 5)),                      # column weight
    (SliceSpec(0, 12), (12,)),                        # column bias
    (SliceSpec(1, 8), (3, 8)),                        # row weight
    (SliceSpec(0, 12, fused=(4, 4, 4)), (12, 3)),     # fused QKV
    (SliceSpec(0, 10, padded_size=12), (10, 3)),      # padded vocabulary
])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_runs_place_every_local_element_at_its_logical_index(spec, shape, size):
    if spec.padded_size and spec.padded_size % size or any(f % size for f in spec.fused or (shape[spec.dim],)):
        pytest.skip("not divisible")
    logical = torch.arange(torch.Size(shape).numel()).view(shape)
    for rank in range(size):
        local = slice_tensor(logical, spec, TensorRegion(None, size, rank))
        slicing = ParamSlicing(spec, tuple(local.shape), rank, size)
        assert slicing.logical_shape == shape
        for start, length in [(0, local.numel()), (1, local.numel() - 2), (3, 4)]:
            if length <= 0 or start + length > local.numel():
                continue
            rebuilt = torch.full((length,), -1)
            for logical_start, run, offset in slicing.runs(start, length):
                rebuilt[offset: offset + run] = torch.arange(logical_start, logical_start + run)
            expected = local.flatten()[start: start + length].clone()
            if spec.padded_size:  # padding rows are zeros in the slice and belong to no run
                padding = (torch.arange(start, start + length) // shape[1] + rank * local.shape[0]) >= shape[0]
                expected[padding] = -1
            assert torch.equal(rebuilt, expected), (rank, start, length)
