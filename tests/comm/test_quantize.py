"""Block-wise quantization (zerodist/comm/quantize.py): error bounds, packing, sizes, the wire form."""

from __future__ import annotations

import math

import pytest
import torch

from zerodist.comm.quantize import (
    DEFAULT_BLOCK,
    QuantError,
    dequantize,
    from_wire,
    quantization_error,
    pack_nibbles,
    quantize_blockwise,
    quantize_rows,
    quantized_nbytes,
    unpack_nibbles,
)

pytestmark = pytest.mark.unit


def _block_scales(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Each element's block scale, recomputed independently (max |x| of its block / qmax)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    nb = math.ceil(flat.numel() / block)
    padded = torch.zeros(nb * block)
    padded[:flat.numel()] = flat
    scales = padded.reshape(nb, block).abs().amax(dim=1) / (2 ** (bits - 1) - 1)
    return scales.repeat_interleave(block)[:flat.numel()]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel, block", [(1, 16), (7, 16), (256, 64), (1000, 64), (4097, DEFAULT_BLOCK)])
def test_round_trip_within_half_a_scale(bits, dtype, numel, block):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    q = quantize_blockwise(x, bits, block)
    y = dequantize(q, torch.float32)
    assert y.shape == x.shape and dequantize(q).dtype == dtype
    bound = _block_scales(x, bits, block) / 2
    # fp32 arithmetic (x * qmax / absmax, then q * scale) adds a few ulps to the exact bound
    slack = 4 * torch.finfo(torch.float32).eps * x.float().abs() + 1e-30
    assert torch.all((x.float() - y).abs() <= bound + slack)
    # a block's largest element is represented (to a few ulps): the scale is absmax / qmax
    i = int(x.float().abs().argmax())
    assert abs(float(y[i]) - float(x[i])) <= 4 * torch.finfo(torch.float32).eps * abs(float(x[i]))


@pytest.mark.parametrize("bits", [8, 4])
def test_integers_on_the_grid_are_exact_and_int4_packs_every_nibble(bits):
    qmax = 2 ** (bits - 1) - 1
    # every representable level, in every position of a byte, with the block's max = qmax so scale = 1
    levels = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
    x = torch.cat([levels, levels.flip(0), torch.tensor([qmax, -qmax, 0.0, 1.0])])
    q = quantize_blockwise(x, bits, block=x.numel())
    assert float(q.scales[0]) == 1.0
    assert torch.equal(dequantize(q), x)
    if bits == 4:
        assert q.payload.dtype == torch.uint8 and q.payload.numel() == x.numel() // 2
        low = (q.payload.reshape(-1) & 0x0F).to(torch.int8)
        low = torch.where(low > 7, low - 16, low)
        assert torch.equal(low.float(), x[0::2])  # element 2i in the low nibble
    else:
        assert q.payload.dtype == torch.int8 and torch.equal(q.payload.reshape(-1).float(), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_and_zero_blocks_dequantize_to_exact_zeros(bits):
    x = torch.zeros(100)
    x[40:48] = torch.tensor([1.0, -2.0, 3.0, 0.5, 0.25, -0.125, 7.0, -7.0])
    q = quantize_blockwise(x, bits, block=16)
    y = dequantize(q)
    assert torch.all(torch.isfinite(y))
    assert q.scales[0] == 0 and q.scales[-1] == 0
    assert torch.equal(y[:32], torch.zeros(32)) and torch.equal(y[48:], torch.zeros(52))
    assert torch.equal(dequantize(quantize_blockwise(torch.zeros(33), bits, 8)), torch.zeros(33))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 300])
def test_nbytes_formula_and_wire_round_trip(bits, numel):
    block = 16
    x = torch.randn(numel)
    q = quantize_blockwise(x, bits, block)
    nblocks = math.ceil(numel / block)
    assert q.nbytes == quantized_nbytes(numel, bits, block) == nblocks * (block * bits // 8 + 4)
    wire = q.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == q.nbytes
    back = from_wire(wire, numel, bits, block)
    assert torch.equal(back.scales, q.scales) and torch.equal(dequantize(back), dequantize(q, torch.float32))


def test_shape_and_dtype_are_kept():
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    q = quantize_blockwise(x, 8, 8)
    assert dequantize(q).shape == (3, 5, 7) and dequantize(q).dtype == torch.bfloat16
    assert dequantize(q, torch.float64).dtype == torch.float64


def test_int8_error_is_about_sixteen_times_smaller_than_int4():
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    e8 = quantization_error(x, dequantize(quantize_blockwise(x, 8, 256)))
    e4 = quantization_error(x, dequantize(quantize_blockwise(x, 4, 256)))
    # uniform rounding error: rel L2 ~ (scale / sqrt(12)) / rms(x); scale ratio 127 / 7 ~ 18
    assert 10 < e4.rel_l2 / e8.rel_l2 < 25
    assert e8.rel_l2 < 0.01 and e4.rel_l2 < 0.15


@pytest.mark.parametrize("bits, block, message", [
    (2, 16, "bits must be one of"), (16, 16, "bits must be one of"), (8, 0, "positive int"),
    (4, 15, "block must be even"),
])
def test_bad_format_is_refused_by_name(bits, block, message):
    with pytest.raises(ValueError, match=message):
        quantize_blockwise(torch.randn(4), bits, block)
    with pytest.raises(ValueError, match=message):
        quantized_nbytes(4, bits, block)


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match="floating-point"):
        quantize_blockwise(torch.arange(4), 8, 4)


def test_quantization_error_measure():
    exact = torch.tensor([3.0, 4.0])
    assert quantization_error(exact, exact) == QuantError(0.0, 0.0)
    err = quantization_error(exact, torch.tensor([3.0, 3.0]))
    assert err.max_abs == 1.0 and err.rel_l2 == pytest.approx(1.0 / 5.0)
    assert quantization_error(torch.zeros(2), torch.zeros(2)).rel_l2 == 0.0
    assert quantization_error(torch.zeros(2), torch.ones(2)).rel_l2 == math.inf
    with pytest.raises(ValueError, match="elements"):
        quantization_error(torch.zeros(2), torch.zeros(3))


def test_nibble_packing_int16_path_equals_the_strided_reference():
    every = torch.arange(-8, 8, dtype=torch.int8)
    q = torch.cartesian_prod(every, every).reshape(2, -1)  # every (low, high) pair, in two rows
    fast, strided = pack_nibbles(q, strided=False), pack_nibbles(q, strided=True)
    assert fast.dtype == strided.dtype == torch.uint8 and torch.equal(fast, strided)
    assert sorted(fast.reshape(-1).tolist()) == list(range(256))  # every byte value occurs once
    for packed in (fast, torch.arange(256, dtype=torch.uint8).reshape(4, 64)):
        assert torch.equal(unpack_nibbles(packed, strided=False), unpack_nibbles(packed, strided=True))
    assert torch.equal(unpack_nibbles(fast), q)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_makes_its_whole_block_non_finite(bits, bad):
    x = torch.randn(48)
    x[20] = bad
    y = dequantize(quantize_blockwise(x, bits, block=16))
    assert not torch.isfinite(y[16:32]).any()  # the overflow is still visible after dequantizing
    assert torch.isfinite(y[:16]).all() and torch.isfinite(y[32:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_never_writes_into_the_callers_tensor(dtype):
    base = torch.randn(64, 6).to(dtype)
    for view in (base.reshape(-1), base.t(), base[:, 1:5], base.reshape(-1)[:250]):  # exact, strided, padded
        before = view.clone()
        quantize_blockwise(view, 4, 16)
        quantize_rows(view.reshape(1, -1) if view.dim() == 1 else view, 8, 16)
        assert torch.equal(view, before)
