"""A flat group's starting values, equal on every rank of its domain group (rank 0's win, as in DDP).

Ranks built with the same seed already agree, so a digest (16 bytes each) is compared first and
the values move only when some rank differs. With sharded parameters each parameter's own storage
is released as soon as it is copied (its data becomes its placeholder), so building a unit needs
about one unit of extra memory, not two.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.zero.layout import FlatLayout
from zerodist.zero.param_storage import ParamRecord


def initial_shard(records: list[ParamRecord], layout: FlatLayout, rank: int, group: Group) -> torch.Tensor | None:
    """Stage 3: this rank's shards of the initial values, concatenated, built without the full
    flat buffer: a digest of every parameter (in layout order) is compared across ranks first,
    and only if they agree is each parameter's owned part copied and its storage released.
    None when the ranks differ (or on GPU): then rank 0's values are broadcast in full."""
    first = records[0].param
    if first.is_cuda:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for record in records:
        digest.update(record.slot.offset.to_bytes(8, "little"))
        digest.update(record.param.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    if not _ranks_agree(digest.digest(), group):
        return None
    pieces: list[tuple[int, int, int]] = []  # this rank's range of each bucket, and where it lands in the shard
    start = 0
    for span in layout.buckets:
        low = span.shard_offset(rank)
        pieces.append((low, low + span.shard_numel, start))
        start += span.shard_numel
    shard = torch.zeros(layout.shard_numel, dtype=first.dtype, device=first.device)
    for record in records:
        flat, slot = record.param.detach().reshape(-1), record.slot
        for low, high, at in pieces:
            begin, end = max(low, slot.offset), min(high, slot.offset + slot.numel)
            if begin < end:
                shard[at + begin - low: at + end - low].copy_(flat[begin - slot.offset: end - slot.offset])
        record.param.data = record.sharded_data
    return shard


def gather_initial_values(records: list[ParamRecord], layout: FlatLayout, group: Group) -> torch.Tensor:
    """The parameters' values in flat layout, identical on every rank of `group`; parameters with a
    placeholder (sharded) become it as soon as they are copied."""
    first = records[0].param
    buffer = torch.zeros(layout.total_numel, dtype=first.dtype, device=first.device)
    for record in records:
        slot = record.slot
        buffer[slot.offset: slot.offset + slot.numel].copy_(record.param.detach().reshape(-1))
        if record.placeholder is not None:
            record.param.data = record.placeholder
    _agree_or_broadcast(buffer, group)
    return buffer


def _agree_or_broadcast(buffer: torch.Tensor, group: Group) -> None:
    """Make `buffer` equal to the group's first rank's. Ranks built with the same seed already
    agree: compare a digest (16 bytes each) and move the values only if some rank differs."""
    if buffer.is_cuda:
        comm.broadcast(buffer, src=comm.get_global_rank(group, 0), group=group)
        return
    digest = hashlib.blake2b(buffer.view(torch.uint8).numpy().data, digest_size=16).digest()
    if not _ranks_agree(digest, group):
        comm.broadcast(buffer, src=comm.get_global_rank(group, 0), group=group)


def _ranks_agree(digest: bytes, group: Group) -> bool:
    """Whether every rank of `group` holds the same `digest` (one small all-gather)."""
    digests: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(digests, digest, group=group)
    return len(set(digests)) == 1
