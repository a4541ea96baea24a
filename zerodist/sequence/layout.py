"""Pure arithmetic of sequence parallelism: which tokens a rank holds, what the degree must divide,
and how many bytes each method moves. No processes, no torch.distributed.

Two layouts of a sequence of N tokens over P ranks:
- contiguous (Ulysses): rank r holds tokens [r N/P, (r+1) N/P). The all-to-all gathers the
  slices back in rank order, so each rank sees the whole sequence in order.
- head-tail (the ring, causal): the sequence is cut into 2P chunks and rank r holds chunks r and
  2P-1-r ([Note: head-tail balance]).

[Note: head-tail balance] Under a causal mask, query chunk c attends to chunks 0..c only, so with
contiguous slices the last rank does P times the work of the first. Holding one chunk from the
head and its mirror from the tail gives every rank chunks whose indices sum to 2P-1, the same
amount of attention work on every rank (torch's `_HeadTailLoadBalancer`, Megatron's context
parallel). The data loader hands each rank its two chunks, with their position ids, so nothing
but the attention needs to know.
"""

from __future__ import annotations

import dataclasses

import torch

from zerodist.sequence.errors import SequenceParallelError

METHODS = ("ulysses", "ring", "manual")


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Which tokens rank `rank` of `size` holds: contiguous slices, or head-tail chunks."""

    rank: int
    size: int
    head_tail: bool = False

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.head_tail and self.size > 1 else 1

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunk numbers (of `size * chunks_per_rank`) that `rank` holds, in order."""
        r = self.rank if rank is None else rank
        if self.chunks_per_rank == 1:
            return (r,)
        return (r, 2 * self.size - 1 - r)

    def check_length(self, length: int) -> int:
        """The length of one chunk; a named error when the layout cannot cut `length` evenly."""
        pieces = self.size * self.chunks_per_rank
        if length % pieces:
            how = (f"{self.size} ranks x 2 chunks (the ring's head-tail balance)" if self.chunks_per_rank == 2
                   else f"{self.size} sequence-parallel ranks")
            raise SequenceParallelError(
                f"sequence length {length} is not divisible by {how} = {pieces}: pad or cut the sequences to a "
                f"multiple of {pieces} (the padding labelled -100 so that it does not count in the loss)")
        return length // pieces

    def token_indices(self, length: int) -> torch.Tensor:
        """Positions (0..length-1) of the tokens this rank holds, in the order it holds them."""
        chunk = self.check_length(length)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunk_ids()])


def check_heads(num_heads: int, num_kv_heads: int, degree: int) -> None:
    """Ulysses needs the degree to divide the query heads, and the key/value heads to be divisible
    by it or to divide it (then they are replicated up to the degree)."""
    if degree == 1:
        return
    if num_heads % degree:
        raise SequenceParallelError(
            f"Ulysses sequence parallelism splits attention heads over the sequence ranks, but {num_heads} heads "
            f"are not divisible by sequence_parallel_size={degree}; choose a degree that divides {num_heads}, or use "
            "the ring (zerodist.sequence_parallel.method: 'ring'), which works for any degree")
    if num_kv_heads % degree and degree % num_kv_heads:
        raise SequenceParallelError(
            f"{num_kv_heads} key/value heads with sequence_parallel_size={degree}: Ulysses needs the key/value "
            "heads divisible by the degree, or the degree divisible by them (the heads are then replicated); "
            "choose another degree, or use the ring (zerodist.sequence_parallel.method: 'ring')")


def ulysses_kv_heads(num_kv_heads: int, degree: int) -> int:
    """Key/value heads as they travel: replicated up to the degree when fewer."""
    return max(num_kv_heads, degree)


def ulysses_bytes(*, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, degree: int,
                  element_size: int) -> int:
    """Bytes one rank sends in one attention layer's forward (the backward sends the same again):
    q, k, v and the output, each all-to-all'd once, (P-1)/P of a [B, N/P, heads, d] slice each."""
    travelling = 2 * heads + 2 * ulysses_kv_heads(kv_heads, degree)
    return element_size * batch * seq * head_dim * travelling * (degree - 1) // (degree * degree)


def ring_bytes(*, batch: int, seq: int, kv_heads: int, head_dim: int, degree: int, element_size: int) -> int:
    """Bytes one rank sends in one attention layer's forward: a K/V block (2 e B (N/P) H_kv d)
    passed on P-1 times around the ring, 2 (P-1) blocks' worth of K and V slices."""
    return 2 * element_size * batch * seq * kv_heads * head_dim * (degree - 1) // degree


def ring_backward_bytes(*, batch: int, seq: int, kv_heads: int, head_dim: int, degree: int, element_size: int) -> int:
    """Bytes one rank sends in one attention layer's backward: the K/V blocks rotate again (P-1
    hops) and so do their dK/dV accumulators, one hop more to reach their owners (P hops)."""
    block = 2 * element_size * batch * seq * kv_heads * head_dim // degree
    return block * (2 * degree - 1)
