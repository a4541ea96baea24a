"""Block-wise symmetric quantization (ZeRO++'s qwZ / qgZ number format), pure and single-process.

    q = quantize_blockwise(x, bits=8, block=256)     # Quantized: payload + one fp32 scale per block
    y = dequantize(q, torch.float32)                 # |x - y| <= scale/2 per element
    q.nbytes == quantized_nbytes(x.numel(), 8, 256)  # what it occupies (and what a collective moves)
    err = quantization_error(x, y)                   # QuantError(max_abs, rel_l2)

[Note: block-wise symmetric quantization] `x` (any shape, any floating dtype) is read as a flat
vector in fp32, padded with zeros to a whole number of blocks of `block` elements and viewed as
(nblocks, block). Each block b gets `scale[b] = max|x in b| / qmax`, qmax = 2**(bits-1) - 1
(127 for int8, 7 for int4: the symmetric range [-qmax, qmax], as DeepSpeed's symmetric
quantizer), and each element `q = round(x / scale)` (to nearest, ties to even), so
`|x - q * scale| <= scale / 2` in exact arithmetic (fp32 adds a few ulps). A block of zeros has
scale 0 and q 0, and dequantizes to exact zeros. All of it is vectorised over the (nblocks,
block) view: no Python loop per block.

[Note: non-finite input] A block holding inf or NaN gets a non-finite scale (NaN propagates
through the max; inf makes the scale inf), so every element of that block dequantizes to inf or
NaN: an overflow check after a quantized reduction (fp16 loss scaling) still sees the overflow.

Storage: bits=8 keeps q as int8, one byte per element; bits=4 packs two elements per byte
(uint8; element 2i in the low nibble, 2i+1 in the high nibble, each a 4-bit two's complement),
so `block` must be even for bits=4. Scales are fp32. A `Quantized` of `numel` elements therefore
occupies exactly

    quantized_nbytes(numel, bits, block) = nblocks * (block * bits // 8 + 4),  nblocks = ceil(numel / block)

bytes (the padding of the last block included), and `to_wire()` lays them out as one flat uint8
buffer: the payload, then the scales' bytes. That buffer is what the quantized collectives
(quantized.py) send, so the tracer counts exactly this many bytes per quantized chunk.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

SUPPORTED_BITS = (4, 8)
DEFAULT_BLOCK = 256
SCALE_BYTES = 4  # one fp32 scale per block


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A block-quantized vector: `payload` (int8 for bits=8; uint8, two per byte, for bits=4,
    shape (nblocks, block * bits // 8)), `scales` (fp32, shape (nblocks,)), and what restores it:
    the original `numel`, `shape` and `dtype`."""

    payload: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nblocks(self) -> int:
        return self.scales.numel()

    @property
    def nbytes(self) -> int:
        """The bytes this occupies: payload plus scales (= `quantized_nbytes(numel, bits, block)`)."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * SCALE_BYTES

    def to_wire(self) -> torch.Tensor:
        """One flat uint8 buffer of `nbytes` bytes: the payload, then the scales' bytes."""
        return torch.cat([self.payload.reshape(-1).view(torch.uint8), self.scales.reshape(-1).view(torch.uint8)])


def check_format(bits: int, block: int) -> None:
    """Raise ValueError unless (bits, block) is a supported format."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantization bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"quantization block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"bits=4 packs two elements per byte, so block must be even; got block={block}")


def num_blocks(numel: int, block: int) -> int:
    return math.ceil(numel / block) if numel > 0 else 0


def payload_nbytes_per_block(bits: int, block: int) -> int:
    return block * bits // 8


def quantized_nbytes(numel: int, bits: int, block: int) -> int:
    """Exact bytes a `Quantized` of `numel` elements occupies (payload with the last block's
    padding, plus one fp32 scale per block): nblocks * (block * bits // 8 + 4)."""
    check_format(bits, block)
    return num_blocks(numel, block) * (payload_nbytes_per_block(bits, block) + SCALE_BYTES)


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_rows(rows: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D tensor (C, n) on its own (no block straddles two rows).

    Returns (payload, scales) of shapes (C, nb, block * bits // 8) and (C, nb), nb = ceil(n / block).
    The building block of `quantize_blockwise` and of the collectives, which quantize one chunk
    per destination rank."""
    check_format(bits, block)
    if rows.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor (chunks, elements), got shape {tuple(rows.shape)}")
    if not rows.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {rows.dtype}")
    count, n = rows.shape
    nb = num_blocks(n, block)
    x = rows.to(torch.float32)
    if nb * block != n:
        x = torch.nn.functional.pad(x, (0, nb * block - n))
    x = x.reshape(count, nb, block)
    # a copy made above (cast, padding, gathering a strided view) is scaled in place; the caller's memory never is
    scratch = x.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    # max |x| per block without a full-size |x| temporary; NaN propagates (see [Note: non-finite input])
    absmax = torch.maximum(x.amax(dim=2), x.amin(dim=2).neg_())
    qmax = _qmax(bits)
    scales = absmax / qmax
    # zero blocks: scale 0, and multiply by 0 instead of dividing by it
    inverse = torch.where(absmax > 0, qmax / torch.where(absmax > 0, absmax, 1.0), 0.0)
    scaled = x.mul_(inverse.unsqueeze(2)) if scratch else torch.mul(x, inverse.unsqueeze(2))
    q = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q, scales
    return pack_nibbles(q), scales


# [Note: nibble packing] Element 2i goes to the low nibble of byte i, 2i+1 to the high one, each
# as 4-bit two's complement. On a little-endian machine an int16 view of the int8 values holds
# element 2i in its low byte and 2i+1 in its high byte, so packing and unpacking are a few
# contiguous int16 operations (measured ~3.5x and ~1.6x faster than strided even/odd slices on
# one CPU thread); the strided form is the reference, and the path of big-endian machines.
_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_nibbles(q: torch.Tensor, *, strided: bool = not _LITTLE_ENDIAN) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8, two per byte ([Note: nibble packing])."""
    if strided:
        return ((q[..., 0::2] & 0x0F) | (q[..., 1::2] << 4)).view(torch.uint8)
    pairs = q.contiguous().view(torch.int16)
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, *, strided: bool = not _LITTLE_ENDIAN) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 -> int8 values in [-8, 7], twice as many in the last dim."""
    signed = packed.contiguous().view(torch.int8)
    if strided:
        q = torch.empty(*signed.shape[:-1], 2 * signed.shape[-1], dtype=torch.int8, device=signed.device)
        q[..., 0::2] = (signed << 4) >> 4
        q[..., 1::2] = signed >> 4
        return q
    wide = signed.to(torch.int16)  # byte b, sign-extended
    # low byte: b's low nibble in its top 4 bits; high byte: b's high nibble in its top 4 bits
    pairs = ((wide << 4) & 0x00F0) | ((wide << 8) & -0x1000)
    return pairs.view(torch.int8) >> 4  # arithmetic shift: each nibble sign-extended


def dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, bits: int, n: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_rows`: (C, nb, block * bits // 8) payload and (C, nb) scales to a
    (C, n) tensor of `dtype` (computed in fp32, then cast)."""
    q = payload.view(torch.int8) if bits == 8 else unpack_nibbles(payload)
    values = q.to(torch.float32).mul_(scales.to(torch.float32).unsqueeze(-1))
    count = values.shape[0]
    return values.reshape(count, -1)[:, :n].to(dtype)


def rows_to_wire(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`quantize_rows`' output as a (C, nbytes) uint8 tensor: each row is one chunk's payload,
    then its scales' bytes (the layout of `Quantized.to_wire()`)."""
    count = scales.shape[0]
    return torch.cat([payload.reshape(count, -1).view(torch.uint8),
                      scales.reshape(count, -1).contiguous().view(torch.uint8)], dim=1)


def rows_from_wire(wire: torch.Tensor, bits: int, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `rows_to_wire` for chunks of `n` elements: (C, nbytes) uint8 to (payload, scales)."""
    count, nb = wire.shape[0], num_blocks(n, block)
    per_block = payload_nbytes_per_block(bits, block)
    expected = nb * (per_block + SCALE_BYTES)
    if wire.dtype != torch.uint8 or wire.numel() != count * expected:
        raise ValueError(f"{count} wire chunks of {n} elements at bits={bits}, block={block} are {count * expected} "
                         f"uint8 bytes; got {wire.numel()} of {wire.dtype}")
    wire = wire.reshape(count, expected)
    payload = wire[:, :nb * per_block].reshape(count, nb, per_block)
    if nb == 0:
        return payload, torch.empty(count, 0, dtype=torch.float32, device=wire.device)
    scales = wire[:, nb * per_block:].contiguous().view(torch.float32)
    return payload, scales


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize `x` (any shape, any floating dtype) block-wise to `bits` (8 or 4) with one fp32
    scale per `block` elements of its flat view ([Note: block-wise symmetric quantization])."""
    flat = x.detach().reshape(1, -1)
    payload, scales = quantize_rows(flat, bits, block)
    return Quantized(payload[0], scales[0], x.numel(), bits, block, tuple(x.shape), x.dtype)


def dequantize(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values `q` stands for, in `dtype` (default: the quantized tensor's dtype), with its shape."""
    values = dequantize_rows(q.payload.unsqueeze(0), q.scales.unsqueeze(0), q.bits, q.numel,
                             q.dtype if dtype is None else dtype)
    return values.reshape(q.shape)


def from_wire(wire: torch.Tensor, numel: int, bits: int, block: int, dtype: torch.dtype = torch.float32,
              shape: tuple[int, ...] | None = None) -> Quantized:
    """The `Quantized` whose `to_wire()` is `wire` (a flat uint8 buffer of `quantized_nbytes` bytes)."""
    check_format(bits, block)
    payload, scales = rows_from_wire(wire.reshape(1, -1), bits, block, numel)
    payload = payload[0].view(torch.int8) if bits == 8 else payload[0]
    scales = scales[0]
    return Quantized(payload, scales, numel, bits, block, (numel,) if shape is None else shape, dtype)


@dataclasses.dataclass(frozen=True)
class QuantError:
    """How far `approx` is from `exact`: the largest absolute difference and the relative L2 error
    ||exact - approx|| / ||exact|| (0 when both are zero; inf when only `exact` is)."""

    max_abs: float
    rel_l2: float


def quantization_error(exact: torch.Tensor, approx: torch.Tensor) -> QuantError:
    """The error of `approx` against `exact` (same numel), measured in fp64."""
    if exact.numel() != approx.numel():
        raise ValueError(f"quantization_error: {exact.numel()} exact elements against {approx.numel()} approximate")
    a = exact.detach().reshape(-1).to(torch.float64)
    b = approx.detach().reshape(-1).to(torch.float64)
    if a.numel() == 0:
        return QuantError(0.0, 0.0)
    diff = a - b
    max_abs = float(diff.abs().max())
    norm, diff_norm = float(a.norm()), float(diff.norm())
    rel = diff_norm / norm if norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    return QuantError(max_abs, rel)
