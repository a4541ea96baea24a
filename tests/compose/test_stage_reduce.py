"""A stage's REDUCE_GRAD reduces that stage's gradient buckets when it runs ([Note: pipeline under
ZeRO] in zerodist/engine/pipeline.py): with interleaved virtual stages (2 per rank) the later
chunk's gradients are complete before the rank's last backward, and their reduce-scatters now run
then, not after it. pipe 2 x data 2 on 4 gloo ranks, an 8-layer MLP, ZeRO 1 (buckets of 100
elements) and 3 (every layer a unit): in the tracer's order on pipe rank 1 (stages 1 and 3) a
gradient reduce-scatter comes before its last message (stage 1's last backward sending its input
gradient), where the reduction at the rank's last REDUCE_GRAD comes after every message; the
parameters equal that run's bitwise and one process's within 1e-6."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import run_distributed
from tests.pipe.test_pipeline_engine import GAS, STEPS, check_against_reference, config, micro_batch, mlp_layers
from zerodist.engine.pipeline import StageGathers
from zerodist.pipe import PipelineModule

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def body(stage: int, early: bool):
    StageGathers.reduce_early = early  # this process's runs only (each test body runs in fresh ranks)
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", stages_per_rank=2)
    settings = config(stage, "interleaved")
    if stage == 3:
        settings["zerodist"]["stage3_unit_classes"] = ["Sequential", "Linear"]
        settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine = zerodist.initialize(model=module, config=settings)[0]
    data_rank = engine.topology.axis_rank("data")
    losses, states, orders = [], [], []
    for step in range(STEPS):
        with comm.trace() as trace:
            losses.append(engine.train_batch(iter([micro_batch(step, m, data_rank, torch.float32)
                                                   for m in range(GAS)])).item())
        ops = [(r.op, r.label) for r in trace.records]
        last_send = max(i for i, (op, label) in enumerate(ops) if op == "send" and label == "pipe")
        first_reduction = min(i for i, (op, _) in enumerate(ops) if op == "reduce_scatter")
        orders.append(first_reduction < last_send)
        states.append({k: v.clone() for k, v in engine.module_state_dict().items()})
    pipe_rank = engine.topology.axis_rank("pipe")
    engine.destroy()
    StageGathers.reduce_early = True
    return losses, states, None, None, orders, pipe_rank


@pytest.mark.parametrize("stage", [1, 3])
def test_a_later_virtual_stage_is_reduced_before_the_rank_last_backward(stage):
    early = run_distributed(body, 4, stage, True, timeout=300)
    late = run_distributed(body, 4, stage, False, timeout=300)
    check_against_reference([r[:4] for r in early], 2, "float32")
    for now, then in zip(early, late):
        assert now[5] == then[5]
        if now[5] == 1:
            assert all(now[4]) and not any(then[4]), (now[4], then[4])
        for ours, theirs in zip(now[1], then[1]):  # bitwise: each bucket reduced once, whenever
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
