"""The side table of declared placements (zerodist/comm/domains.py): pure, no processes."""

import pytest
import torch

from zerodist.comm import DENSE, EXPERT, TENSOR_SLICE, Domain
from zerodist.comm.domains import Placement, declare_placement, parameter_placements
from zerodist.comm.errors import TopologyError


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
