"""The Topology: pure arithmetic, then real groups across ranks."""

import pytest
import torch

import zerodist.comm as comm
from zerodist.comm.topology import axis_partition, coords_of, rank_of, resolve_degrees
from tests.harness import DistributedTestFailure, distributed_test, run_distributed


@pytest.mark.unit
def test_degrees_default_data_takes_the_rest():
    assert resolve_degrees(8, tensor=2) == {"pipe": 1, "data": 4, "expert": 1, "sequence": 1, "tensor": 2}
    assert resolve_degrees(8, expert=2, tensor=2) == {"pipe": 1, "data": 2, "expert": 2, "sequence": 1, "tensor": 2}
    assert resolve_degrees(16, pipe=2, sequence=2, tensor=2) == {"pipe": 2, "data": 2, "expert": 1, "sequence": 2,
                                                                "tensor": 2}


@pytest.mark.unit
@pytest.mark.parametrize(
    "world, kwargs, fragment",
    [
        (8, {"data": 3}, "data (3) x expert (1) x tensor (1) = 3, but the world size is 8"),
        (6, {"tensor": 4}, "world size 6 is not divisible by expert (1) x tensor (4) = 4"),
        (4, {"tensor": 0}, "tensor degree must be a positive integer"),
        (4, {"data": 2, "expert": 2, "tensor": 2}, "= 8, but the world size is 4"),
        (6, {"pipe": 4}, "world size 6 is not divisible by pipe (4) x expert (1) x tensor (1) = 4"),
        (8, {"data": 2, "sequence": 2}, "data (2) x expert (1) x sequence (2) x tensor (1) = 4, but the world size is 8"),
        (4, {"sequence": True}, "sequence degree must be a positive integer"),
    ],
)
def test_degrees_that_do_not_fit_list_every_factor(world, kwargs, fragment):
    with pytest.raises(comm.TopologyError) as info:
        resolve_degrees(world, **kwargs)
    assert fragment in str(info.value)


@pytest.mark.unit
def test_coordinates_round_trip_and_tensor_is_innermost():
    degrees = {"data": 2, "expert": 3, "tensor": 2}
    for rank in range(12):
        assert rank_of(coords_of(rank, degrees), degrees) == rank
    assert coords_of(1, degrees) == {"pipe": 0, "data": 0, "expert": 0, "sequence": 0, "tensor": 1}
    assert coords_of(6, degrees) == {"pipe": 0, "data": 1, "expert": 0, "sequence": 0, "tensor": 0}


@pytest.mark.unit
def test_partitions():
    degrees = {"data": 2, "expert": 1, "tensor": 2}
    assert axis_partition(degrees, ("tensor",)) == [[0, 1], [2, 3]]
    assert axis_partition(degrees, ("data",)) == [[0, 2], [1, 3]]
    assert axis_partition(degrees, ("data", "tensor")) == [[0, 1, 2, 3]]
    assert axis_partition(degrees, ("expert",)) == [[0], [1], [2], [3]]
    degrees = {"data": 2, "expert": 2, "tensor": 1}
    assert axis_partition(degrees, ("data",)) == [[0, 2], [1, 3]]
    assert axis_partition(degrees, ("data", "expert")) == [[0, 1, 2, 3]]


@distributed_test(world_size=4)
def test_groups_reduce_over_their_axis_only():
    topo = comm.Topology(data=2, tensor=2)
    rank = comm.get_rank()
    assert topo.degrees == {"pipe": 1, "data": 2, "expert": 1, "sequence": 1, "tensor": 2}
    assert topo.ranks("tensor") == [rank - rank % 2, rank - rank % 2 + 1]
    assert topo.ranks("data") == [rank % 2, rank % 2 + 2]
    assert topo.size("data", "tensor") == 4 and topo.size("expert") == 1
    assert topo.axis_rank("tensor") == rank % 2
    for axes in [("tensor",), ("data",), ("expert",), ("data", "tensor")]:
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=topo.group(*axes))
        assert t.item() == sum(topo.ranks(*axes)), axes
    with pytest.raises(comm.TopologyError, match="unknown axis"):
        topo.group("pipeline")
    with pytest.raises(AttributeError):
        topo.rank = 3  # immutable


@distributed_test(world_size=4)
def test_gradient_groups_are_second_groups_over_the_same_ranks_made_once_per_world():
    """[Note: gradient groups]: a distinct group over the same ranks for each group of more than one
    rank (the same group for one rank, and without gradient groups); later Topologies of the same
    world reuse the groups, so initialising many engines holds no more threads or sockets."""
    plain = comm.Topology(data=2, tensor=2)
    topo = comm.Topology(data=2, tensor=2, gradient_groups=True)
    rank = comm.get_rank()
    for axes in [("tensor",), ("data",), ("data", "tensor")]:
        assert topo.gradient_group(*axes) is not topo.group(*axes)
        assert plain.gradient_group(*axes) is plain.group(*axes)
        assert topo.group(*axes) is plain.group(*axes)  # made once per world
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=topo.gradient_group(*axes))
        assert t.item() == sum(topo.ranks(*axes)), axes
    assert topo.gradient_group("expert") is topo.group("expert")  # one rank: nothing to order
    again = comm.Topology(data=2, tensor=2, gradient_groups=True)
    assert all(again.gradient_group(*axes) is topo.gradient_group(*axes) for axes in [("tensor",), ("data",)])


def _mismatched_topology():
    comm.Topology(tensor=2 if comm.get_rank() == 0 else 1)


@pytest.mark.multiprocess
def test_ranks_asking_for_different_topologies_fail_on_every_rank():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_mismatched_topology, 2)
    message = str(info.value)
    assert "failed on 2 of 2" in message
    assert "rank 0: data=None expert=1 tensor=2; rank 1: data=None expert=1 tensor=1" in message
