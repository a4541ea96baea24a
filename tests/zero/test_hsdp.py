"""`zerodist.hsdp` (FSDP2 / torchtitan's naming of hierarchical sharding) is MiCS: the same run, bit for
bit; a replicate degree that disagrees with the topology, or a shard degree that disagrees with
`mics_shard_size`, is refused by name ([Note: HSDP naming] in zerodist/config/zeropp_sections.py)."""

from __future__ import annotations

import pytest
import torch

import zerodist
from zerodist.comm.errors import TopologyError
from zerodist.config import Config, ConfigError
from zerodist.models import make_mlp
from tests.engine_helpers import train_distributed
from tests.harness import distributed_test
from tests.zero.test_mics import config


def hsdp(shard: int, replicate: int | None = None, **zero) -> dict:
    cfg = config(**zero)
    cfg["zerodist"] = {**cfg["zerodist"], "hsdp": {"shard_degree": shard, "replicate_degree": replicate}}
    return cfg


@pytest.mark.unit
def test_hsdp_shard_degree_is_mics_shard_size():
    assert Config.load(hsdp(2, 2)).zero_optimization.mics_shard_size == 2
    assert Config.load(hsdp(2, mics_shard_size=2)).zero_optimization.mics_shard_size == 2  # both, equal: fine
    with pytest.raises(ConfigError, match=r"'zerodist.hsdp.shard_degree' \(2\) and 'zero_optimization.mics_shard_size' "
                                          r"\(4\) name the same shard group size differently"):
        Config.load(hsdp(2, mics_shard_size=4))


@distributed_test(world_size=4)
def test_hsdp_is_the_same_run_as_mics():
    torch.manual_seed(0)
    _, mics = train_distributed(config(mics_shard_size=2), 4)
    torch.manual_seed(0)
    _, named = train_distributed(hsdp(2, 2), 4)
    for key in mics:
        assert torch.equal(mics[key], named[key]), key


@distributed_test(world_size=4)
def test_hsdp_replicate_degree_disagreeing_with_the_topology_is_refused_on_every_rank():
    with pytest.raises(TopologyError, match=r"shard_degree \(2\) x replicate_degree \(4\) must be the 4 ranks"):
        zerodist.initialize(model=make_mlp(), config=hsdp(2, 4))
