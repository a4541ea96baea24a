"""ZeRO++ (issue 36): hpZ's secondary partition on 2 simulated nodes x 2 ranks: the bytes per link
class against docs/design/zero.md's formulas, and bitwise equality with plain ZeRO-3."""

from __future__ import annotations

import pytest
import torch

import zerodist
from zerodist.comm.errors import TopologyError
from zerodist.models import make_mlp
from tests.engine_helpers import train_distributed
from tests.harness import distributed_test
from tests.zero.test_mics import _bulk_bus_bytes, _traced_step, config


@distributed_test(world_size=4)
def test_hpz_backward_gather_stays_within_the_node():
    t, psi, _ = _traced_step(config(zero_hpz_partition_size=2))
    d, k, b = 4, 2, 4
    gathers = [r for r in t.records if r.op == "all_gather" and r.numel > 64]
    assert {r.link for r in gathers} == {"intra", "inter"}
    inter_gathered = sum(r.numel for r in gathers if r.link == "inter")
    intra_gathered = sum(r.numel for r in gathers if r.link == "intra")
    assert inter_gathered == intra_gathered == psi  # forward from the primary shards, backward within the node
    sent = _bulk_bus_bytes(t)
    assert sent["inter"] == pytest.approx(2 * psi * b * (d - 1) / d)  # forward all-gather + reduce-scatter
    assert sent["intra"] == pytest.approx(psi * b * (k - 1) / k)  # backward all-gather


@pytest.mark.parametrize("accumulation", [1, 2])
@distributed_test(world_size=4)
def test_hpz_bitwise_equal_to_plain_zero3(accumulation):
    plain_cfg, hpz_cfg = config(), config(zero_hpz_partition_size=2)
    for cfg in (plain_cfg, hpz_cfg):
        cfg["gradient_accumulation_steps"] = accumulation
    torch.manual_seed(0)
    _, plain = train_distributed(plain_cfg, 4)
    torch.manual_seed(0)
    _, hpz = train_distributed(hpz_cfg, 4)
    for key in plain:
        assert torch.equal(plain[key], hpz[key]), key


@distributed_test(world_size=4)
def test_hpz_beside_mics_gathers_within_the_shard_group():
    """MiCS shard groups of 2 (one per node) and hpZ over the same 2 ranks: the secondary would be the
    primary partition, so every gather stays within the node and nothing else changes."""
    t, psi, _ = _traced_step(config(zero_hpz_partition_size=2, mics_shard_size=2))
    gathers = [r for r in t.records if r.op == "all_gather" and r.numel > 64]
    assert {r.link for r in gathers} == {"intra"} and sum(r.numel for r in gathers) == 2 * psi


@distributed_test(world_size=4)
def test_hpz_size_not_dividing_the_shard_group_is_refused():
    with pytest.raises(TopologyError, match=r"zero_hpz_partition_size' \(3\) must divide the 4 ranks"):
        zerodist.initialize(model=make_mlp(), config=config(zero_hpz_partition_size=3))


@pytest.mark.unit
def test_hpz_with_parameter_offload_is_refused_by_the_config():
    from zerodist.config import Config, ConfigError
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        Config.load({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2,
                                           "offload_param": {"device": "cpu"}}})
