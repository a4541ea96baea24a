"""Past one machine (issue 36): simulated nodes, bytes per link class, MiCS / HSDP hierarchical
sharding, communication_data_type. 4 ranks = 2 simulated nodes x 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.comm import nodes
from zerodist.comm.errors import TopologyError
from zerodist.comm.topology import split_partition
from zerodist.models import make_mlp
from tests.engine_helpers import assert_close_relative, base_config, global_batch, train_distributed, train_reference
from tests.harness import distributed_test

# One unit per Linear, every parameter sharded, and every unit re-gathered in backward (DeepSpeed's
# ZeRO-3 formulas count the backward all-gather): the bytes then follow docs/design/zero.md exactly.
STAGE3 = {"zerodist": {"stage3_unit_classes": ["Linear"], "simulated_nodes": 2},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}


def config(stage: int = 3, **zero) -> dict:
    result = base_config(stage, **{key: dict(value) for key, value in STAGE3.items()})
    result["zero_optimization"] = {**result["zero_optimization"], "stage": stage, **zero}
    return result


@pytest.mark.unit
def test_split_partition_blocks_and_replicas():
    inner, outer = split_partition([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert inner == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert outer == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(TopologyError):
        split_partition([[0, 1, 2]], 2)


@pytest.mark.unit
def test_nodes_from_launcher_and_simulation(monkeypatch):
    monkeypatch.delenv(nodes.ENV_SIMULATED, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert nodes.ranks_per_node(8) == 4 and nodes.node_of(5, 8) == 1
    assert nodes.link_of_ranks([0, 3], 8) == "intra" and nodes.link_of_ranks([3, 4], 8) == "inter"
    monkeypatch.setenv(nodes.ENV_SIMULATED, "4")
    assert nodes.ranks_per_node(8) == 2
    nodes.simulate_nodes(1)
    try:
        assert nodes.ranks_per_node(8) == 8
    finally:
        nodes.simulate_nodes(None)
    monkeypatch.setenv(nodes.ENV_SIMULATED, "3")
    with pytest.raises(TopologyError, match="divisor of 8"):
        nodes.ranks_per_node(8)


def _traced_step(cfg: dict) -> tuple[comm.Trace, int, object]:
    """Two steps; the second is traced. Returns the trace, this rank's padded numel Ψ of the sharded
    groups (every group at this config), and the engine."""
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=cfg)
    n, rank, micro = comm.get_world_size(), comm.get_rank(), engine.batch.micro_batch_size
    for step in range(2):
        x, y = global_batch(step, micro * n)
        rows = slice(rank * micro, (rank + 1) * micro)
        with comm.trace(ops=["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]) as t:
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    psi = sum(g.layout.total_numel for g in engine.groups)
    return t, psi, engine


def _check_library_formula(t: comm.Trace, engine) -> None:
    """zerodist.zero.link_bytes (what `zerodist train`'s summary prints) agrees with the measurement."""
    from zerodist.zero.link_bytes import link_bus_bytes, regathered_groups
    formula = link_bus_bytes(engine.groups, engine.topology, regathered=regathered_groups(engine.stage3))
    sent = _bulk_bus_bytes(t)
    assert formula["intra"] == pytest.approx(sent["intra"]) and formula["inter"] == pytest.approx(sent["inter"])


def _bulk_bus_bytes(t: comm.Trace) -> dict[str, float]:
    """Bus bytes per link class of the parameter and gradient collectives (the step's few scalar
    all-reduces, loss and norm agreement, are left out: they are not in the formulas)."""
    out = {"intra": 0.0, "inter": 0.0}
    for r in t.records:
        if r.numel > 64:
            out[r.link] += r.bus_bytes
    return out


@distributed_test(world_size=4)
def test_plain_zero3_bytes_all_cross_nodes():
    t, psi, engine = _traced_step(config())
    _check_library_formula(t, engine)
    d, b = 4, 4  # fp32
    sent = _bulk_bus_bytes(t)
    assert sent["intra"] == 0
    assert sent["inter"] == pytest.approx(3 * psi * b * (d - 1) / d)  # 2Ψ gathered + Ψ reduce-scattered


@distributed_test(world_size=4)
def test_mics_bytes_per_link_class():
    t, psi, engine = _traced_step(config(mics_shard_size=2))
    s, r, b = 2, 2, 4
    _check_library_formula(t, engine)
    sent = _bulk_bus_bytes(t)
    assert psi == sum(g.layout.total_numel for g in engine.groups)
    assert sent["intra"] == pytest.approx(3 * psi * b * (s - 1) / s)
    assert sent["inter"] == pytest.approx(2 * (psi / s) * b * (r - 1) / r)


@pytest.mark.parametrize("stage", [1, 2, 3])
@distributed_test(world_size=4)
def test_mics_parity_with_single_process(stage):
    _, state = train_distributed(config(stage, mics_shard_size=2), 6)
    reference, _ = train_reference(6, rows=16)
    assert_close_relative(state, reference, 1e-6)


@distributed_test(world_size=4)
def test_mics_clipped_norm_counts_each_shard_once():
    cfg = config(mics_shard_size=2)
    cfg["gradient_clipping"] = 0.05
    _, state = train_distributed(cfg, 4)
    reference, _ = train_reference(4, rows=16, clip=0.05)
    assert_close_relative(state, reference, 1e-6)


@distributed_test(world_size=4)
def test_mics_shard_size_not_dividing_data_degree_is_refused_on_every_rank():
    with pytest.raises(TopologyError, match=r"mics_shard_size' \(3\) must divide the data-parallel degree \(4\)"):
        zerodist.initialize(model=make_mlp(), config=config(mics_shard_size=3))


@distributed_test(world_size=4)
def test_hierarchical_gather_across_nodes_is_refused():
    cfg = config(mics_shard_size=4 // 2 * 2, mics_hierarchical_params_gather=True)
    cfg["zerodist"] = {**cfg["zerodist"], "simulated_nodes": 4}  # one rank per node: a group of 2 spans two
    cfg["zero_optimization"]["mics_shard_size"] = 2
    with pytest.raises(TopologyError, match="mics_hierarchical_params_gather"):
        zerodist.initialize(model=make_mlp(), config=cfg)


@distributed_test(world_size=2)
def test_communication_data_type_fp32_reduces_bf16_gradients_in_fp32():
    cfg = config(2)
    cfg["bf16"] = {"enabled": True}
    cfg["communication_data_type"] = "fp32"
    t, _, engine = _traced_step(cfg)
    scattered = [r for r in t.records if r.op == "reduce_scatter"]
    assert scattered and all(r.dtype == torch.float32 for r in scattered)
    assert all(g.grad_shard is not None and g.grad_shard.dtype == torch.bfloat16 for g in engine.groups)


@distributed_test(world_size=4)
def test_mics_checkpoint_loads_into_plain_zero3():
    """A MiCS run's checkpoint, loaded at plain ZeRO-3 (and back into MiCS): the same parameters."""
    import tempfile
    directory = [tempfile.mkdtemp(prefix="mics-ckpt-") if comm.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory)
    engine, state = train_distributed(config(mics_shard_size=2), 3)
    engine.save_checkpoint(directory[0], tag="t")
    for keys in ({}, {"mics_shard_size": 2}):
        torch.manual_seed(1)
        other, _, _, _ = zerodist.initialize(model=make_mlp(), config=config(**keys))
        other.load_checkpoint(directory[0], tag="t")
        loaded = other.module_state_dict()
        for key in state:
            assert torch.equal(loaded[key], state[key]), (keys, key)
    torch.distributed.barrier()
    if comm.get_rank() == 0:
        import shutil
        shutil.rmtree(directory[0])


@distributed_test(world_size=2)
def test_communication_data_type_of_the_gradients_own_type_changes_nothing():
    """fp32 gradients reduced in fp32 (and bf16 in bf16) are the default's bits: no cast runs."""
    for precision, dtype in ((None, "fp32"), ({"enabled": True}, "bf16")):
        plain_cfg, typed_cfg = config(3), config(3)
        if precision is not None:
            plain_cfg["bf16"] = typed_cfg["bf16"] = precision
        typed_cfg["communication_data_type"] = dtype
        _, plain = train_distributed(plain_cfg, 3)
        _, typed = train_distributed(typed_cfg, 3)
        for key in plain:
            assert torch.equal(plain[key], typed[key]), (dtype, key)


@distributed_test(world_size=2)
def test_bf16_gradients_reduced_in_fp32_train_close_to_one_process():
    cfg = config(3)
    cfg["bf16"] = {"enabled": True}
    cfg["communication_data_type"] = "fp32"
    _, state = train_distributed(cfg, 4)
    reference, _ = train_reference(4, rows=8)
    assert_close_relative({k: v.float() for k, v in state.items()}, reference, 2e-2)


@distributed_test(world_size=2)
def test_mics_shard_size_one_replicates_everything():
    """Shard groups of one rank: every rank holds the whole state and the gradients are all-reduced (DDP)."""
    _, state = train_distributed(config(3, mics_shard_size=1), 4)
    reference, _ = train_reference(4, rows=8)
    assert_close_relative(state, reference, 1e-6)
