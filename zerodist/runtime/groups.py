"""``deepspeed.utils.groups`` under ``import deepspeed`` served by zerodist: the data-parallel,
sequence-parallel and model-parallel queries accelerate and DeepSpeed scripts make, answered from the
topology of the last engine ``initialize()`` built with a mesh or mpu request or sequence, tensor or
pipeline parallelism, until its ``destroy()`` (DeepSpeed's groups are process-wide and set by its
engine only when it has a mesh or an mpu, so a later plain engine, such as TRL's reference model,
leaves them alone); before any such engine, from zerodist's world (data parallel over every rank, no
sequence or model parallelism)."""

from __future__ import annotations

from typing import Any

import zerodist.comm as comm
from zerodist.engine.deepspeed_surface import latest_engine


def _topology() -> Any:
    engine = latest_engine()
    return getattr(engine, "topology", None) if engine is not None else None


def _get_data_parallel_world_size() -> int:
    topology = _topology()
    return comm.get_world_size() if topology is None else int(topology.num_batch_shards)


def _get_data_parallel_rank() -> int:
    topology = _topology()
    return comm.get_rank() if topology is None else int(topology.axis_rank(*topology.batch_axes))


def _get_data_parallel_group() -> Any:
    topology = _topology()
    return comm.get_world_group() if topology is None else topology.group(*topology.batch_axes)


def _get_sequence_parallel_world_size() -> int:
    topology = _topology()
    return 1 if topology is None else int(topology.size(*topology.sequence_axes))


def _get_sequence_parallel_rank() -> int:
    topology = _topology()
    return 0 if topology is None else int(topology.axis_rank(*topology.sequence_axes))


def _get_sequence_parallel_group() -> Any:
    topology = _topology()
    if topology is None or topology.size(*topology.sequence_axes) == 1:
        raise KeyError("No sequence parallel group found")  # DeepSpeed's error without a sequence-parallel mesh
    return topology.group(*topology.sequence_axes)


def _get_sequence_data_parallel_world_size() -> int:
    topology = _topology()
    return comm.get_world_size() if topology is None else int(topology.size(*topology.batch_axes,
                                                                             *topology.sequence_axes))


def _get_sequence_data_parallel_group() -> Any:
    topology = _topology()
    return comm.get_world_group() if topology is None else topology.group(*topology.batch_axes,
                                                                            *topology.sequence_axes)


def _get_model_parallel_world_size() -> int:
    topology = _topology()
    return 1 if topology is None else int(topology.size(*topology.tensor_axes))


get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
