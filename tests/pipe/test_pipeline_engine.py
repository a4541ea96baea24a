"""Pipeline parallelism end to end: `initialize(model=PipelineModule(...))` and `train_batch`, on
gloo ranks, against one process doing gradient accumulation over the same micro-batches.

An 8-layer MLP, 4 micro-batches, 5 steps, SGD with momentum: after every step the parameters of
every stage equal the reference's within 1e-6, and `train_batch` returns the same
loss on every rank, equal to the reference's mean loss."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import DistributedTestFailure, run_distributed
from zerodist.pipe import PipelineModule, TiedLayerSpec

WIDTH, LAYERS, MICRO, GAS, STEPS = 8, 8, 4, 4, 5


def mlp_layers(dtype: torch.dtype = torch.float32) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index in range(LAYERS):
        layers.append(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) if index < LAYERS - 1
                      else torch.nn.Linear(WIDTH, WIDTH))
    return [layer.to(dtype) for layer in layers]


def micro_batch(step: int, micro: int, data_rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + data_rank)
    return (torch.randn(MICRO, WIDTH, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(MICRO, WIDTH, generator=g, dtype=torch.float64).to(dtype))


def config(stage: int, schedule: str = "1f1b", **zerodist_section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "allgather_bucket_size": 100},
        "zerodist": {"pipeline": {"schedule": schedule, **zerodist_section}},
    }


def reference(data: int, dtype: torch.dtype, clip: float = 0.0) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process: the same layers as nn.Sequential, gradient accumulation over the micro-batches
    of every data rank (each micro-step's batch is the data ranks' micro-batches together)."""
    model = torch.nn.Sequential(*mlp_layers(dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, states = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            parts = [micro_batch(step, micro, d, dtype) for d in range(data)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / GAS).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses, states


# Megatron's MLP pairs for pipe x tensor: even layers split their outputs, odd ones their inputs
TENSOR_SPECS = {"layer_specs": [
    {"patterns": [rf"^{i}\.0\.(weight|bias)$" for i in range(0, LAYERS, 2)], "partition_type": "column"},
    {"patterns": [rf"^{i}(\.0)?\.weight$" for i in range(1, LAYERS, 2)], "partition_type": "row"}]}


def pipeline_body(pipe: int, stage: int, schedule: str, dtype_name: str, stages_per_rank: int = 1, tensor: int = 1,
                  clip: float = 0.0):
    dtype = getattr(torch, dtype_name)
    module = PipelineModule(mlp_layers(dtype), num_stages=pipe, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform", stages_per_rank=stages_per_rank)
    settings = config(stage, schedule)
    if tensor > 1:
        settings["tensor_parallel"] = {"autotp_size": tensor, "partition_config": TENSOR_SPECS}
    if clip:
        settings["gradient_clipping"] = clip
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    data_rank = engine.topology.axis_rank("data")
    losses, states, sent = [], [], []
    for step in range(STEPS):
        batches = iter([micro_batch(step, micro, data_rank, dtype) for micro in range(GAS)])
        with comm.trace() as trace:
            loss = engine.train_batch(batches)
        sent.append(trace.total_bytes("send"))
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in engine.module_state_dict().items()})
    peak = engine.last_run.peak_stashed
    engine.destroy()
    return losses, states, sent, peak


def check_against_reference(results, data: int, dtype_name: str, clip: float = 0.0) -> None:
    dtype = getattr(torch, dtype_name)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    ref_losses, ref_states = reference(data, dtype, clip)
    keys = set()
    for losses, states, _, _ in results:
        assert losses == results[0][0], "train_batch returns the same loss on every rank"
        assert losses == pytest.approx(ref_losses, rel=tolerance, abs=tolerance)
        for step, state in enumerate(states):
            for key, value in state.items():
                keys.add(key)
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=tolerance), (step, key)
    assert keys == set(ref_states[0]), "the stages' state-dict keys together are nn.Sequential's"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipe2_equals_gradient_accumulation(stage):
    results = run_distributed(pipeline_body, 2, 2, stage, "1f1b", "float32")
    check_against_reference(results, 1, "float32")
    # stage 0 holds min(p - i, m) = 2 micro-batches' activations under 1F1B, the last stage 1
    assert [r[3] for r in results] == [2, 1]
    # 2 m activations of micro-batch activation bytes cross the one boundary per step (m forward, m back)
    activation_bytes = MICRO * WIDTH * 4
    for step in range(STEPS):
        assert sum(r[2][step] for r in results) == 2 * GAS * activation_bytes


@pytest.mark.parametrize("stage", [2, 3])
def test_pipe2_data2(stage):
    results = run_distributed(pipeline_body, 4, 2, stage, "1f1b", "float32")
    check_against_reference(results, 2, "float32")


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_other_schedules_equal_gradient_accumulation(schedule):
    results = run_distributed(pipeline_body, 2, 2, 1, schedule, "float32")
    check_against_reference(results, 1, "float32")
    if schedule == "gpipe":
        assert [r[3] for r in results] == [GAS, GAS]


def test_pipe4_equals_gradient_accumulation():
    results = run_distributed(pipeline_body, 4, 4, 1, "1f1b", "float32")
    check_against_reference(results, 1, "float32")
    assert [r[3] for r in results] == [4, 3, 2, 1]  # min(p - i, m) under 1F1B


def test_interleaved_two_stages_per_rank():
    results = run_distributed(pipeline_body, 2, 2, 2, "interleaved", "float32", 2)
    check_against_reference(results, 1, "float32")


@pytest.mark.parametrize("world, pipe, stage, data", [(2, 2, 1, 1), (4, 2, 2, 2), (4, 2, 3, 2), (4, 4, 1, 1)],
                         ids=["pipe2-zero1", "pipe2xdata2-zero2", "pipe2xdata2-zero3", "pipe4-zero1"])
def test_fp64_model_trains_in_fp64_within_1e12(world, pipe, stage, data):
    """An all-fp64 model trains in fp64 (no bf16/fp16 section): parameters and losses within 1e-12
    of one process's gradient accumulation in fp64 (an fp32 cast anywhere would miss by ~1e-8)."""
    results = run_distributed(pipeline_body, world, pipe, stage, "1f1b", "float64")
    check_against_reference(results, data, "float64")
    for _, states, _, _ in results:
        assert all(v.dtype == torch.float64 for v in states[-1].values())


def reduction_body(stage: int) -> dict[str, int]:
    """What one train_batch reduces over the data-parallel group, against this stage's parameters."""
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, _, _, _ = zerodist.initialize(model=module, config=config(stage))
    data_rank = engine.topology.axis_rank("data")
    batches = iter([micro_batch(0, micro, data_rank, torch.float32) for micro in range(GAS)])
    with comm.trace() as trace:
        engine.train_batch(batches)
    reduced = trace.total_numel("reduce_scatter")
    counts = {"reduced": reduced, "reductions": trace.count("reduce_scatter"),
              "buckets": len(engine.reducer.order),
              "own": sum(p.numel() for p in engine.module.parameters()),
              "flat": sum(p.numel() for g in engine.groups for p in g.params),
              "padded": sum(g.layout.total_numel for g in engine.groups)}
    engine.destroy()
    return counts


@pytest.mark.parametrize("stage", [1, 2])
def test_data_parallel_reduction_covers_the_stage_only_once_per_batch(stage):
    for counts in run_distributed(reduction_body, 4, stage):
        # one reduce-scatter per gradient bucket per batch (not per micro-batch), of this stage's
        # parameters only (the world's would be twice as many)
        assert counts["reductions"] == counts["buckets"], counts
        assert counts["flat"] == counts["own"] == 4 * (WIDTH * WIDTH + WIDTH), counts  # the stage's 4 layers
        assert counts["reduced"] == counts["padded"], counts  # its flat groups (bucket padding included)


@pytest.mark.parametrize("stage", [1, 3])
def test_pipe2_tensor2(stage):
    results = run_distributed(pipeline_body, 4, 2, stage, "1f1b", "float32", 1, 2)
    check_against_reference(results, 1, "float32")


def test_gradient_clipping_uses_the_norm_over_every_stage():
    # the norm is agreed over the world (both stages' parameters): clipping equals one process's
    results = run_distributed(pipeline_body, 4, 2, 2, "1f1b", "float32", 1, 1, 0.05)
    check_against_reference(results, 2, "float32", clip=0.05)


def tied_tensor_body() -> None:
    torch.manual_seed(0)
    layers = [TiedLayerSpec("edge", torch.nn.Linear, WIDTH, WIDTH), torch.nn.Tanh(),
              torch.nn.Linear(WIDTH, WIDTH), TiedLayerSpec("edge", torch.nn.Linear, WIDTH, WIDTH)]
    module = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    settings = config(1)
    settings["tensor_parallel"] = {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [r"^\d+\.weight$"], "partition_type": "column"}]}}
    zerodist.initialize(model=module, config=settings)


def test_a_tied_layer_made_tensor_parallel_is_refused_by_name():
    """A plan that swaps a tied layer for a tensor-parallel one would leave the tie on parameters
    nobody trains (the copies drifting apart unseen): refused by name on every rank."""
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(tied_tensor_body, 4, timeout=60)
    # The first stage's ranks: the pipeline's check. The last stage's: the plan's own, which sees the tied
    # module under both of its names ([Note: a tied module's first name] in zerodist/pipe/module.py).
    message = str(failure.value)
    assert message.count("tied layers cannot be tensor-parallel yet") == 2
    assert message.count("are one tied parameter; tensor parallelism slices each layer on its own") == 2
