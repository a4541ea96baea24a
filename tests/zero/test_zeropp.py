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
from tests.zero.test_mics import _bulk_bus_bytes, _check_library_formula, _traced_step, config


@distributed_test(world_size=4)
def test_hpz_backward_gather_stays_within_the_node():
    t, psi, engine = _traced_step(config(zero_hpz_partition_size=2))
    _check_library_formula(t, engine)
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


def _q(numel: int, bits: int) -> int:
    """Bytes of one block-quantized chunk (zerodist.comm.quantize.quantized_nbytes)."""
    from zerodist.comm.quantize import quantized_nbytes
    return quantized_nbytes(numel, bits, 256)


def _expected(engine, *, qwz: bool, qgz: bool, hpz: bool, d: int = 4, per_node: int = 2, b: int = 4) -> dict:
    """docs/design/zero.md's bus bytes per link class for one ZeRO-3 step on `d` ranks in nodes of
    `per_node`, bucket by bucket (a quantized chunk's scales round up per bucket shard)."""
    nodes_ = d // per_node
    intra = inter = 0.0
    for group in engine.groups:
        for span in group.layout.buckets:
            s = span.shard_numel
            gather = d * _q(s, 8) if qwz else span.numel * b  # the gathered output, as the tracer counts it
            inter += gather * (d - 1) / d  # forward
            if hpz:
                intra += span.numel * b * (per_node - 1) / per_node  # backward, within the node, dequantized values
            else:
                inter += gather * (d - 1) / d
            if qgz:
                intra += d * _q(s, 4) * (per_node - 1) / per_node  # hop 1: every destination's chunk
                inter += nodes_ * _q(s, 4) * (nodes_ - 1) / nodes_  # hop 2: 1/per_node of it
            else:
                inter += span.numel * b * (d - 1) / d
    return {"intra": intra, "inter": inter}


@pytest.mark.parametrize("mode", ["qwz", "qgz", "zeropp"])
@distributed_test(world_size=4)
def test_quantized_bytes_per_link_class(mode):
    keys = {"qwz": {"zero_quantized_weights": True}, "qgz": {"zero_quantized_gradients": True},
            "zeropp": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                       "zero_hpz_partition_size": 2}}[mode]
    t, _, engine = _traced_step(config(**keys))
    expected = _expected(engine, qwz=mode != "qgz", qgz=mode != "qwz", hpz=mode == "zeropp")
    sent = _bulk_bus_bytes(t)
    _check_library_formula(t, engine)
    assert sent["intra"] == pytest.approx(expected["intra"])
    assert sent["inter"] == pytest.approx(expected["inter"])
    if mode == "zeropp":
        plain = _expected(engine, qwz=False, qgz=False, hpz=False)
        assert plain["intra"] == 0 and sent["inter"] <= 0.25 * plain["inter"]


@distributed_test(world_size=4)
def test_zeropp_trains_close_to_exact():
    """All three ZeRO++ levers against plain ZeRO-3: the same loss curve to within the quantization's error."""
    from tests.engine_helpers import global_batch
    import torch.nn.functional as F
    losses = {}
    for name, keys in (("exact", {}), ("zeropp", {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                                   "zero_hpz_partition_size": 2})):
        torch.manual_seed(0)
        engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config(**keys))
        n, rank, micro = 4, torch.distributed.get_rank(), engine.batch.micro_batch_size
        curve = []
        for step in range(20):
            x, y = global_batch(step, micro * n)
            loss = F.mse_loss(engine(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
            engine.backward(loss)
            engine.step()
            curve.append(float(loss))
        losses[name] = curve
    assert losses["zeropp"] != losses["exact"]  # quantization did happen
    assert abs(losses["zeropp"][-1] - losses["exact"][-1]) <= 0.05 * abs(losses["exact"][-1])


LLAMA_MODES = {"plain": {}, "mics": {"mics_shard_size": 2}, "hpz": {"zero_hpz_partition_size": 2},
               "qwz": {"zero_quantized_weights": True}, "qgz": {"zero_quantized_gradients": True},
               "zeropp": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                          "zero_quantized_gradients": True}}


def _llama_step_bytes(keys: dict) -> tuple[dict, dict]:
    """Two steps of a tiny HF Llama at ZeRO-3 (a unit per decoder layer), the second traced:
    (measured bus bytes per link class, the formula's)."""
    from tests.hf_models import hf_batch, hf_class, hf_config, hf_loss
    from zerodist.comm import trace
    from zerodist.zero.link_bytes import link_bus_bytes, regathered_groups
    cfg = config(**keys)
    cfg["zerodist"] = {**cfg["zerodist"], "stage3_unit_classes": ["LlamaDecoderLayer"]}
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=hf_class("llama")(hf_config("llama")), config=cfg)
    rank, micro = torch.distributed.get_rank(), engine.batch.micro_batch_size
    for step in range(2):
        with trace(ops=["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]) as t:
            engine.backward(hf_loss(engine, hf_batch(step, 4 * micro)[rank * micro:(rank + 1) * micro]))
            engine.step()
    formula = link_bus_bytes(engine.groups, engine.topology, regathered=regathered_groups(engine.stage3))
    return _bulk_bus_bytes(t), formula


@pytest.mark.slow
@distributed_test(world_size=4)
def test_llama_bytes_per_link_class_equal_the_formulas():
    """Every mode on an HF Llama, 2 simulated nodes x 2 ranks: the tracer equals the formula per link
    class, hpZ's backward crosses no node, and all three ZeRO++ levers cross nodes at <= 0.25x plain."""
    measured = {}
    for mode, keys in LLAMA_MODES.items():
        sent, formula = _llama_step_bytes(keys)
        for link in ("intra", "inter"):
            assert sent[link] == pytest.approx(formula[link]), (mode, link, sent, formula)
        measured[mode] = sent
    assert measured["plain"]["intra"] == 0
    assert measured["hpz"]["inter"] < measured["plain"]["inter"] and measured["hpz"]["intra"] > 0
    assert measured["zeropp"]["inter"] <= 0.25 * measured["plain"]["inter"]


@distributed_test(world_size=4)
def test_hpz_copy_never_outlives_a_checkpoint_load():
    """A training forward keeps hpZ's copy; a checkpoint loaded before the next forward must not let
    that forward read the old values: the same losses as plain ZeRO-3 doing the same."""
    import tempfile
    import torch.nn.functional as F
    from tests.engine_helpers import global_batch
    directory = [tempfile.mkdtemp(prefix="hpz-ckpt-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory)
    rank, losses = torch.distributed.get_rank(), {}
    for name, keys in (("plain", {}), ("hpz", {"zero_hpz_partition_size": 2})):
        torch.manual_seed(0)
        engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config(**keys))
        x, y = global_batch(0, 16)
        rows = slice(rank * 4, (rank + 1) * 4)
        if name == "plain":
            engine.save_checkpoint(directory[0], tag="start")
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        F.mse_loss(engine(x[rows]), y[rows])  # a training forward: hpZ keeps its copy here
        engine.load_checkpoint(directory[0], tag="start")
        losses[name] = float(F.mse_loss(engine(x[rows]), y[rows]))
    assert losses["hpz"] == losses["plain"]
    torch.distributed.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(directory[0])
