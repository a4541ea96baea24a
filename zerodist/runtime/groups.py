"""``deepspeed.utils.groups`` under ``import deepspeed`` served by zerodist: the data-parallel and
sequence-parallel queries accelerate and DeepSpeed scripts make, answered from zerodist's world
(data parallel over every rank; no sequence-parallel group unless an engine built one)."""

from __future__ import annotations

from typing import Any

import zerodist.comm as comm


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    return comm.get_rank()


def _get_data_parallel_group() -> Any:
    return comm.get_world_group()


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_model_parallel_world_size() -> int:
    return 1


get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
