"""MiCS / HSDP and hpZ composed with the other axes (issue 36): the shard, replica and secondary groups
are cut from each tensor rank's data group and from each pipeline stage's ([Note: composed axes] in
zerodist/zero/hierarchy.py). Each combination trains like plain ZeRO-3 on the same mesh (hpZ bitwise,
MiCS within 1e-6: it sums within the shard group, then across) and like one process, and its bytes
per link class equal docs/design/zero.md's formulas (zerodist/zero/link_bytes.py); expert
parallelism is refused by name on every rank before any collective."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.comm.errors import TopologyError
from zerodist.comm.quantized import QGZ_LABEL
from zerodist.zero.link_bytes import step_link_bytes
from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODES = {"plain": {}, "mics": {"mics_shard_size": 2}, "hpz": {"zero_hpz_partition_size": 2}}
QUANTIZED = {"qgz": {"zero_quantized_gradients": True}}


def _whole(state: dict) -> torch.Tensor:
    return torch.cat([state[k].double().reshape(-1) for k in sorted(state)])


def relative(a: dict, b: dict) -> float:
    return float((_whole(a) - _whole(b)).norm() / _whole(b).norm())


def _step_bytes(engine, trace: comm.Trace) -> dict:
    """One traced step's bus bytes per link class: everything measured, docs/design/zero.md's formula
    for ZeRO's collectives (zerodist/zero/link_bytes.py), and the collectives outside ZeRO's group
    (the other axes' own, the step's scalars and objects) where ZeRO's groups are the whole data group."""
    data = engine.topology.size(*engine.topology.dense_axes)
    others = {"intra": 0.0, "inter": 0.0}
    for r in trace.records:
        # sends (pipeline messages) have no link class; object gathers move integers; the loss's scalars
        small = r.dtype is None or not r.dtype.is_floating_point or r.numel <= 8
        if r.link is not None and (r.group_size != data or small):
            others[r.link] += r.bus_bytes
    return {"measured": trace.bus_bytes_by_link(), "formula": step_link_bytes(engine), "others": others}


def check_bytes(results: dict[str, dict]) -> None:
    """Every mode's bytes beyond ZeRO's formula are plain ZeRO-3's collectives outside its data group:
    the other axes' and the scalars, the same in every mode. So each mode's ZeRO bytes equal its formula."""
    plain = results["plain"]
    for link in ("intra", "inter"):
        assert plain["measured"][link] - plain["formula"][link] == pytest.approx(plain["others"][link])
        for mode, result in results.items():
            assert result["measured"][link] - result["formula"][link] == pytest.approx(plain["others"][link]), (mode, link)


def tensor_body(mode: str, steps: int) -> dict:
    """tensor 2 x data 4 on 2 simulated nodes of 4 ranks, ZeRO-3, the tiny GPT (test_tp_engine's)."""
    from tests.tensor_parallel.test_tp_engine import MICRO, SHAPE, _batch, _config
    from zerodist.models.gpt import GPT

    config = _config(3, tensor=2)
    config["zero_optimization"].update({**MODES, **QUANTIZED}[mode], stage3_max_reuse_distance=0)
    config["zerodist"] = {"simulated_nodes": 2, "stage3_unit_classes": ["Block"]}
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=GPT(SHAPE), config=config)
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    losses = []
    for step in range(steps):
        idx, targets = _batch(step, MICRO * shards)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        with comm.trace() as trace:
            loss = engine(idx[rows], targets[rows])
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return {"state": engine.module_state_dict(), "losses": losses, **_step_bytes(engine, trace)}


@pytest.mark.slow
def test_mics_and_hpz_with_tensor_parallelism():
    """tensor 2 x data 4 on 2 nodes of 4 ranks: each tensor rank's data group [t, t+2, t+4, t+6] is cut
    into shard groups (MiCS) or secondary blocks (hpZ) of 2, one per node; only the replica sum
    (MiCS) and the forward gather and reduce-scatter (hpZ) cross nodes."""
    from tests.tensor_parallel.test_tp_engine import MICRO, _reference

    steps = 3
    results = {mode: run_distributed(tensor_body, 8, mode, steps, timeout=400)[0] for mode in MODES}
    # qgZ over each tensor rank's data group: two hops (its 2 ranks per node, then across), by the formula
    check_bytes({**results, "qgz": run_distributed(tensor_body, 8, "qgz", steps, timeout=400)[0]})
    plain, mics, hpz = results["plain"], results["mics"], results["hpz"]
    assert mics["measured"]["inter"] < plain["measured"]["inter"] / 3
    assert all(torch.equal(hpz["state"][k], v) for k, v in plain["state"].items()) and hpz["losses"] == plain["losses"]
    assert relative(mics["state"], plain["state"]) <= 1e-6
    reference, _ = _reference(steps, rows=MICRO * 4)
    for result in results.values():
        assert relative(result["state"], reference) <= 1e-6


def pipe_body(mode: str) -> dict:
    """pipe 2 x data 4 on 4 simulated nodes of 2 ranks, ZeRO-3, 1F1B (test_pipeline_engine's MLP):
    each stage's data group [4p .. 4p+3] spans two nodes; its shard groups / secondary blocks of 2
    are one node each."""
    from tests.pipe.test_pipeline_engine import GAS, STEPS, config, micro_batch, mlp_layers
    from zerodist.pipe import PipelineModule

    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    settings = config(3)
    settings["zero_optimization"].update(MODES[mode], stage3_param_persistence_threshold=0)
    settings["zerodist"]["simulated_nodes"] = 4
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    data_rank = engine.topology.axis_rank("data")
    losses = []
    for step in range(STEPS):
        with comm.trace() as trace:
            losses.append(float(engine.train_batch(iter([micro_batch(step, m, data_rank, torch.float32)
                                                            for m in range(GAS)]))))
    out = {"losses": losses, "state": {k: v.clone() for k, v in engine.module_state_dict().items()},
           **_step_bytes(engine, trace)}
    engine.destroy()
    return out


@pytest.mark.slow
def test_mics_with_a_pipeline():
    """pipe 2 x data 4 on 4 nodes of 2 ranks: each stage's data group is cut into shard groups of 2,
    one per node; a stage gathers and reduces once per batch, within its node, and only the replica
    sum crosses nodes. The same run as one process's gradient accumulation within 1e-6."""
    from tests.pipe.test_pipeline_engine import reference

    results = {mode: run_distributed(pipe_body, 8, mode, timeout=400) for mode in ("plain", "mics")}
    for rank in (0, 4):  # a rank of each stage
        check_bytes({mode: ranks[rank] for mode, ranks in results.items()})
    assert results["mics"][0]["measured"]["inter"] < results["plain"][0]["measured"]["inter"] / 3
    ref_losses, ref_states = reference(4, torch.float32)
    for rank, (plain, mics) in enumerate(zip(results["plain"], results["mics"])):
        assert mics["losses"] == pytest.approx(ref_losses, rel=1e-6) and plain["losses"] == pytest.approx(ref_losses, rel=1e-6)
        stage_keys = sorted(mics["state"])
        assert relative(mics["state"], plain["state"]) <= 1e-6, rank
        assert relative(mics["state"], {k: ref_states[-1][k] for k in stage_keys}) <= 1e-6, rank


def _refusals() -> list[str]:
    """Where ZeRO builds its groups (zerodist/zero/apply.py, before any of its collectives), on 4 ranks."""
    from zerodist.comm.topology import DENSE, Topology
    from zerodist.zero.hierarchy import HierarchySettings, domain_group

    out = []
    for settings, degrees in ((HierarchySettings(hpz_size=2), {"pipe": 2}), (HierarchySettings(shard_size=2), {"expert": 2}),
                              (HierarchySettings(hpz_size=2), {"expert": 2})):
        try:
            domain_group(Topology(**degrees), DENSE, settings)
            out.append("built")
        except TopologyError as error:
            out.append(str(error))
    return out


def test_hpz_with_a_pipeline_and_both_with_experts_are_refused_by_name_on_every_rank():
    for messages in run_distributed(_refusals, 4, timeout=120):
        assert "zero_hpz_partition_size' (2) cannot be combined with pipeline parallelism (pipe degree 2)" in messages[0]
        assert "mics_shard_size' (2) cannot be combined with expert parallelism (expert degree 2)" in messages[1]
        assert "zero_hpz_partition_size' (2) cannot be combined with expert parallelism" in messages[2]


def sequence_body(mode: str) -> dict:
    """sequence 2 x data 2 on 2 simulated nodes of 2 ranks (each node one data index's Ulysses pair),
    ZeRO-3 over the data x sequence group [0, 1, 2, 3]: shard groups / secondary blocks of 2 are one
    node each (test_engine's GPT in tests/sequence)."""
    from tests.sequence.test_engine import MICRO, STEPS, _build, _config, _samples
    from zerodist.sequence import SequenceLayout
    from zerodist.sequence.data import shard_batch

    config = _config(3, 2)
    config["zero_optimization"].update({**MODES, **QUANTIZED}[mode], stage3_max_reuse_distance=0)
    config["zerodist"].update(simulated_nodes=2, stage3_unit_classes=["Block"])
    engine = zerodist.initialize(model=_build("gpt"), config=config)[0]
    topology = engine.topology
    layout = SequenceLayout(topology.axis_rank("sequence"), topology.size("sequence"))
    shard, losses = topology.batch_rank, []
    for step in range(STEPS):
        ids, labels = _samples(step, MICRO * 2)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        with comm.trace() as trace:
            loss = engine(*shard_batch((ids[rows], labels[rows]), layout))
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    out = {"losses": losses, "state": engine.module_state_dict(), **_step_bytes(engine, trace),
           "ulysses": trace.bus_bytes("all_to_all") - trace.labelled_bus_bytes(QGZ_LABEL, "all_to_all"),
           "qgz": trace.labelled_bus_bytes(QGZ_LABEL)}
    engine.destroy()
    return out


@pytest.mark.slow
def test_qgz_all_to_all_is_told_from_ulysses():
    """With Ulysses and qgZ both issuing all-to-alls, the trace tells them apart (qgZ's are labelled):
    Ulysses' bytes are those of the same run without qgZ, so `zerodist train --sp`'s report shows no
    false gap."""
    plain, quantized = (run_distributed(sequence_body, 4, mode, timeout=300)[0] for mode in ("plain", "qgz"))
    assert plain["qgz"] == 0 and quantized["qgz"] > 0
    assert quantized["ulysses"] == plain["ulysses"] > 0


@pytest.mark.slow
def test_mics_and_hpz_with_sequence_parallelism():
    from tests.sequence.test_engine import _reference

    results = {mode: run_distributed(sequence_body, 4, mode, timeout=300)[0] for mode in MODES}
    check_bytes(results)
    plain, mics, hpz = results["plain"], results["mics"], results["hpz"]
    assert mics["measured"]["inter"] < plain["measured"]["inter"] / 3
    assert hpz["measured"]["inter"] < plain["measured"]["inter"]
    assert all(torch.equal(hpz["state"][k], v) for k, v in plain["state"].items()) and hpz["losses"] == plain["losses"]
    reference = _reference("gpt", 2)
    for mode, result in results.items():
        assert relative(result["state"], reference) <= 1e-6, mode
