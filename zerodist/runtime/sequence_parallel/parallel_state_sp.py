"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's module-level sequence-parallel
unit (``initialize_sequence_parallel(size)``, then the getters), DeepSpeed's groups and checks: consecutive
ranks share a sequence group, and the sequence-data-parallel group is the whole world (data x sequence).
Given to ``initialize(mpu=parallel_state_sp)`` it makes the engine's sequence axis of that size, with
DeepSpeed's manual meaning ([Note: DeepSpeed's manual sequence parallelism] in
zerodist/engine/deepspeed_args.py); the model-parallel getters are the sequence ones, as in DeepSpeed."""

from __future__ import annotations

from typing import Any

import zerodist.comm as comm

_STATE: dict[str, Any] = {}


def _release_sequence_parallel_groups() -> None:
    _STATE.clear()


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the sequence groups (consecutive ranks) and the sequence-data group; every rank calls it."""
    world = comm.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size})")
    if _STATE:
        raise RuntimeError("sequence parallel group is already initialized")
    rank = comm.get_rank()
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = comm.new_group(ranks)
        if rank in ranks:
            _STATE.update(sp_group=group, sp_ranks=ranks)
    # DeepSpeed's data x sequence group: world // (sequence x data) = one group of every rank
    _STATE.update(sdp_group=comm.new_group(list(range(world))), sdp_ranks=list(range(world)))
    _STATE["size"] = sequence_parallel_size


def _get(key: str) -> Any:
    if key not in _STATE:
        raise AssertionError("sequence parallel group is not initialized: call initialize_sequence_parallel(size)")
    return _STATE[key]


def get_sequence_parallel_group() -> Any:
    return _get("sp_group")


def get_sequence_parallel_world_size() -> int:
    return int(_get("size"))


def get_sequence_parallel_rank() -> int:
    return int(_get("sp_ranks").index(comm.get_rank()))


def get_sequence_data_parallel_group() -> Any:
    return _get("sdp_group")


def get_sequence_data_parallel_world_size() -> int:
    return len(_get("sdp_ranks"))


def get_sequence_data_parallel_rank() -> int:
    return int(_get("sdp_ranks").index(comm.get_rank()))


# since we only have 1 additional dimension over DP, we can just alias MP with SP (DeepSpeed's words)
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
