"""``deepspeed.runtime.pipe.topology``: DeepSpeed's process topologies and pipeline grid, with its semantics.

A topology lays ranks out on named axes, row-major (the last axis varies fastest): with
``axes=["pipe", "data"]`` and ``dims=[2, 2]`` ranks 0 and 1 are stage 0. ``PipelineParallelGrid``
makes the process groups of such a layout (pipe, data, model, slice) through ``zerodist.comm``.
zerodist's own engine lays out its axes in ``zerodist.comm.Topology``; these classes are for
scripts and tests written against DeepSpeed's.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]


class ProcessTopology:
    """Ranks on the Cartesian product of ``axes`` (sizes ``dims``), row-major."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes but {len(dims)} dims")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank  # type: ignore[arg-type]

    def get_rank(self, **coord_kwargs: int) -> int:
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() needs one coordinate per axis")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): {coord_kwargs} is not in the topology")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: list[str] | tuple[str, ...] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """'axis_NN' for each axis not omitted, joined (checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, index in self.mapping.items():
            if index == rank:
                return coord
        raise ValueError(f"rank {rank} is not in the topology")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """For each combination of the other axes, the ranks along `axis` ([] for an unknown axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates equal every given one, in rank order."""
        return sorted(rank for coord, rank in self.mapping.items()
                      if all(getattr(coord, k) == v for k, v in filter_kwargs.items()))

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        size = 1
        for dim in self.dims:
            size *= dim
        return size

    def __str__(self) -> str:
        return str(self.mapping)


def _prime_factors(n: int) -> list[int]:
    """The prime factors of `n` >= 1, smallest first, with repeats."""
    if n <= 0:
        raise ValueError(f"_prime_factors: {n} is not positive")
    factors, divisor = [], 2
    while n > 1:
        while n % divisor == 0:
            factors.append(divisor)
            n //= divisor
        divisor += 1
    return factors


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline outer, data parallel inner (neighbouring ranks share a stage)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, then data, then model (tensor) parallel innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """This rank's place in a pipe x data (x model) topology, and the process groups along each axis.
    Every rank must build it together (it creates process groups)."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        import zerodist.comm as comm

        if process_group is not None:
            raise ValueError("PipelineParallelGrid(process_group=...) is not supported: the grid spans the world")
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        if topology is None:
            factors = _prime_factors(self.world_size)
            num_pp = factors[-1] if factors else 1
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=self.world_size // num_pp)
        if topology.world_size() != self.world_size:
            raise ValueError(f"the topology has {topology.world_size()} ranks but the world has {self.world_size}")
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.ds_model_proc_group, self.ds_model_rank = None, -1
        self.dp_group, self.dp_proc_group = self._my_group("data", comm)
        self.pp_group, self.pp_proc_group = self._my_group("pipe", comm)
        self.slice_group, self.slice_proc_group = self._my_group("model", comm)
        self.p2p_groups = self._build_p2p_groups()

    def _my_group(self, axis: str, comm: Any) -> tuple[list[int], Any]:
        lists = self._topo.get_axis_comm_lists(axis) or [[r] for r in range(self.world_size)]
        mine: tuple[list[int], Any] = ([self.global_rank], None)
        for ranks in lists:  # every rank makes every group, in the same order
            group = comm.new_group(ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        return mine

    def _build_p2p_groups(self) -> list[list[int]]:
        """[this rank, the same coordinates on the next stage] for every rank (the last stage wraps)."""
        groups = []
        for rank in range(self.world_size):
            coord = self._topo.get_coord(rank)._asdict()
            if "pipe" in coord:
                coord["pipe"] = (coord["pipe"] + 1) % self.pipe_parallel_size
            groups.append([rank, self._topo.get_rank(**coord)])
        return groups

    def _is_grid_valid(self) -> bool:
        return self.data_parallel_size * self.pipe_parallel_size * self.model_parallel_size == self.world_size

    def get_stage_id(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "pipe", 0)

    def get_data_parallel_id(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "data", 0)

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` at this rank's other coordinates (or those given)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
