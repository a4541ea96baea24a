"""Shape agreement: the ranks of a group confirm, before an exchange whose sizes gloo (or NCCL)
would otherwise check by aborting the process, that each brings the same shape.

`agree_shapes(shapes, group, what=..., device=...)` is one `all_reduce(MAX)` of a fixed-length
int64 vector: each rank's values and their negations, so the result holds every slot's maximum and
minimum at once. Its size never depends on the shapes, so the agreement itself cannot be the
mismatched exchange; when some slot's maximum and minimum differ, every rank sees it in the same
result and all of them (not only the odd one) gather each rank's shapes and raise
`CollectiveMismatchError` naming them. On agreement, the cost is one all-reduce of
8 x 2 x 24 = 384 bytes (measured per call in docs/sequence_parallel.md). Shapes that need more
than 24 values keep their first 23 and a 63-bit digest of the whole in the last.

[Note: why not cached per shape] Agreeing once per distinct shape and skipping it for shapes seen
before is not safe: a rank that saw its shape before skips the agreement and enters the exchange,
while a rank with a new shape enters the agreement, and the two then issue different collectives
(gloo aborts or hangs). The check is cheap instead, and its callers place it where one call
covers many exchanges (the engine's sequence step agrees once per forward, not per layer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from zerodist.comm.collectives import Group, ReduceOp, all_gather_object, all_reduce
from zerodist.comm.guard import CollectiveMismatchError
from zerodist.comm.init import get_rank, get_world_size

SLOTS = 24  # values compared: the shapes' dimensions, each shape preceded by its number of dimensions


def _encode(shapes: Sequence[Sequence[int]]) -> list[int]:
    values: list[int] = [len(shapes)]
    for shape in shapes:
        values += [len(shape), *(int(d) for d in shape)]
    if len(values) > SLOTS:  # the rest by a digest (the same on every process, unlike hash())
        digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
        values = values[:SLOTS - 1] + [int.from_bytes(digest, "little") >> 1]
    return values + [-1] * (SLOTS - len(values))


def agree_shapes(shapes: Sequence[Sequence[int]], group: Group, *, what: str,
                 device: torch.device | str = "cpu") -> None:
    """Raise `CollectiveMismatchError` on every rank of `group` unless all bring equal `shapes`
    (a few tuples of ints: tensor shapes, or any integers the exchange depends on)."""
    if get_world_size(group) == 1:
        return
    values = _encode(shapes)
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    all_reduce(both, op=ReduceOp.MAX, group=group)
    maxima, negated_minima = both[:SLOTS], both[SLOTS:]
    if torch.equal(maxima, -negated_minima):
        return
    everyone: list[Any] = [None] * get_world_size(group)
    all_gather_object(everyone, (get_rank(), [tuple(int(d) for d in s) for s in shapes]), group=group)
    described = "; ".join(f"rank {rank}: {brought}" for rank, brought in everyone)
    raise CollectiveMismatchError(f"the ranks of one group disagree on the shapes of {what}, so the exchange cannot "
                                  f"run (gloo would abort the process): {described}. Every rank must bring the same "
                                  "shapes: the same batch size, sequence length and heads on every rank of the group")
