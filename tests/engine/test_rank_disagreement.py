"""Ranks that bring different configs or models fail on every rank naming the key or parameter
that differs, not two digests."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import base_config
from tests.harness import distributed_test
from zerodist.models import make_mlp
from zerodist.utils.differences import differing_entries, flatten


def test_differing_entries_name_each_key_and_its_ranks():
    per_rank = [flatten({"optimizer": {"params": {"lr": 0.01}}, "stage": 2}),
                flatten({"optimizer": {"params": {"lr": 0.02}}, "stage": 2}),
                flatten({"optimizer": {"params": {"lr": 0.01}}})]
    assert differing_entries(per_rank) == ["optimizer.params.lr: 0.01 on rank(s) 0, 2; 0.02 on rank(s) 1",
                                           "stage: 2 on rank(s) 0, 1; '<absent>' on rank(s) 2"]


@distributed_test(world_size=2)
def test_a_differing_learning_rate_is_named():
    rank = comm.get_rank()
    config = base_config(1, optimizer={"type": "AdamW", "params": {"lr": 0.01 * (rank + 1)}})
    with pytest.raises(RuntimeError, match=r"disagree on the config key\(s\):\n  optimizer.params.lr: 0.01 on "
                                           r"rank\(s\) 0; 0.02 on rank\(s\) 1"):
        zerodist.initialize(model=make_mlp(), config=config)


@distributed_test(world_size=2)
def test_a_differing_parameter_shape_is_named():
    model = make_mlp()
    if comm.get_rank() == 1:
        model[0].bias = torch.nn.Parameter(torch.zeros(model[0].bias.numel() + 1))
    with pytest.raises(RuntimeError, match=r"disagree on the model's parameter\(s\) and buffer\(s\) \(name: shape "
                                           r"dtype\):\n  0.bias: '\(\d+,\) torch.float32' on rank\(s\) 0; "):
        zerodist.initialize(model=model, config=base_config(1))


@distributed_test(world_size=2)
def test_a_differing_buffer_shape_is_named_not_a_crash():
    """Buffers are broadcast from the first rank at initialize: one of another length on rank 1 used
    to abort that rank inside gloo ("Received data size doesn't match expected size")."""
    model = make_mlp()
    model[0].register_buffer("table", torch.arange(4.0 + comm.get_rank()))
    with pytest.raises(RuntimeError, match=r"0.table \(buffer\): '\(4,\) torch.float32' on rank\(s\) 0; "
                                           r"'\(5,\) torch.float32' on rank\(s\) 1"):
        zerodist.initialize(model=model, config=base_config(1))
