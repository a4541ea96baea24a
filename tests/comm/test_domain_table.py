"""The side table of declared placements (zerodist/comm/domains.py): pure, no processes."""

import pytest
import torch

from zerodist.comm import DENSE, EXPERT, TENSOR_SLICE, Domain
from zerodist.comm.domains import Placement, declare_placement, parameter_placements
from zerodist.comm.errors import TopologyError

pytestmark = pytest.mark.unit


def test_undeclared_parameters_are_dense_and_nothing_is_written_on_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    declare_placement(model[1], EXPERT)
    placements = parameter_placements(model)
    assert {placements[id(p)].domain for p in model[0].parameters()} == {DENSE}
    assert {placements[id(p)].domain for p in model[1].parameters()} == {EXPERT}
    assert before == {n: set(vars(m)) for n, m in model.named_modules()}


def test_deeper_and_named_declarations_win():
    inner = torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(inner))
    declare_placement(model, EXPERT)
    declare_placement(inner, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor"), names=["weight"])
    placements = parameter_placements(model)
    assert placements[id(inner.weight)] == Placement(TENSOR_SLICE, 0, "tensor")
    assert placements[id(inner.bias)].domain == EXPERT


def test_a_copy_counted_elsewhere_keeps_its_declared_placement():
    from zerodist.comm.domains import declare_counted_elsewhere

    inner = torch.nn.Linear(3, 2)
    tied = torch.nn.Sequential(inner, torch.nn.LayerNorm(2))
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), tied)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    declare_placement(inner, Placement(TENSOR_SLICE, slice_dim=0, slice_axis="tensor"), names=["weight"])
    declare_counted_elsewhere(tied)
    placements = parameter_placements(model)
    assert placements[id(inner.weight)] == Placement(TENSOR_SLICE, 0, "tensor", in_norm=False)
    assert placements[id(tied[1].weight)] == Placement(DENSE, in_norm=False)
    assert all(placements[id(p)] == Placement(DENSE) for p in model[0].parameters())
    assert before == {n: set(vars(m)) for n, m in model.named_modules()}


def test_bad_declarations_are_named():
    with pytest.raises(TopologyError, match="no parameter 'wieght'"):
        declare_placement(torch.nn.Linear(2, 2), DENSE, names=["wieght"])
    with pytest.raises(TopologyError, match="replicated over"):
        Domain(("data", "expert"), ("data",))
    with pytest.raises(TopologyError, match="both slice_dim and slice_axis"):
        Placement(DENSE, slice_dim=0)


def test_norm_axes():
    assert DENSE.norm_axes == ("tensor",)
    assert EXPERT.norm_axes == ("tensor",)
    assert TENSOR_SLICE.norm_axes == ()


def test_logical_names_shift_an_offset_container_and_keep_named_parameters_order():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 4)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    from zerodist.comm.domains import declare_logical_offset, logical_names

    model = torch.nn.ModuleDict({"moe": Layer(), "head": torch.nn.Linear(4, 2)})
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    declare_logical_offset(model["moe"].experts, 4)  # expert-parallel rank 2 of experts in groups of 2
    names = logical_names(model)
    physical = dict(model.named_parameters())
    assert [names[id(p)] for p in physical.values()] == [
        "moe.gate.weight", "moe.gate.bias", "moe.experts.4.weight", "moe.experts.4.bias",
        "moe.experts.5.weight", "moe.experts.5.bias", "head.weight", "head.bias"]
    assert before == {n: set(vars(m)) for n, m in model.named_modules()}
    # a shared parameter is named once, by its first name, as named_parameters() does
    model["tied"] = model["moe"].experts[0]
    assert logical_names(model)[id(model["tied"].weight)] == "moe.experts.4.weight"
    with pytest.raises(TopologyError, match="integer-named children"):
        declare_logical_offset(model["moe"], 1)
    with pytest.raises(TopologyError, match="non-negative"):
        declare_logical_offset(model["moe"].experts, -1)


def test_expert_parallel_degree_is_declared_once_per_model():
    from zerodist.comm.domains import declare_expert_parallel, expert_parallel_degree

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert expert_parallel_degree(model) == 1
    declare_expert_parallel(model[0], 2)
    assert expert_parallel_degree(model) == 2
    declare_expert_parallel(model[1], 4)
    with pytest.raises(TopologyError, match="different expert-parallel degrees"):
        expert_parallel_degree(model)


def test_a_whole_module_declaration_covers_its_buffers():
    from zerodist.comm.domains import buffer_placements

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2))
    declare_placement(model[1], EXPERT)
    declare_placement(model[0], EXPERT, names=["weight"])  # one parameter: not its buffers
    placements = buffer_placements(model)
    assert {placements[id(b)].domain for b in model[1].buffers()} == {EXPERT}
    assert {placements[id(b)].domain for b in model[0].buffers()} == {DENSE}
