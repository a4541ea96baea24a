"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's module-level sequence-parallel
groups (``initialize_sequence_parallel(size)``, then the getters). Consecutive ranks share a sequence
group, as in DeepSpeed; zerodist's engine takes its sequence degree from the config instead
(``zerodist.tensor_parallel.sequence_parallel_size``, docs/sequence.md)."""

from __future__ import annotations

from typing import Any

import zerodist.comm as comm

_STATE: dict[str, Any] = {}


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the sequence groups (consecutive ranks) and the data groups across them; every rank calls it."""
    world = comm.get_world_size()
    if sequence_parallel_size < 1 or world % sequence_parallel_size:
        raise ValueError(f"initialize_sequence_parallel({sequence_parallel_size}): must divide the world size {world}")
    rank = comm.get_rank()
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = comm.new_group(ranks)
        if rank in ranks:
            _STATE.update(sp_group=group, sp_ranks=ranks)
    for offset in range(sequence_parallel_size):
        ranks = list(range(offset, world, sequence_parallel_size))
        group = comm.new_group(ranks)
        if rank in ranks:
            _STATE.update(dp_group=group, dp_ranks=ranks)
    _STATE["size"] = sequence_parallel_size


def _get(key: str) -> Any:
    if key not in _STATE:
        raise RuntimeError("the sequence-parallel groups are not made yet: call initialize_sequence_parallel(size)")
    return _STATE[key]


def get_sequence_parallel_group() -> Any:
    return _get("sp_group")


def get_sequence_parallel_world_size() -> int:
    return int(_get("size"))


def get_sequence_parallel_rank() -> int:
    return int(_get("sp_ranks").index(comm.get_rank()))


def get_sequence_data_parallel_group() -> Any:
    return _get("dp_group")


def get_sequence_data_parallel_world_size() -> int:
    return len(_get("dp_ranks"))


def get_sequence_data_parallel_rank() -> int:
    return int(_get("dp_ranks").index(comm.get_rank()))
