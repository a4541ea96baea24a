"""DeepSpeed's PipelineEngine accessors on zerodist's (`stage_id`, `num_stages`, `grid`,
`set_dataiterator`), and the data `train_batch()` reads itself from `initialize(training_data=...)`
in DeepSpeed's order: `DistributedSampler(shuffle=False)`, repeated, the same order every pass."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

WIDTH, MICRO, GAS, SAMPLES = 4, 2, 2, 12


class Recorder(torch.nn.Module):
    """A first layer that notes which samples (their index is input column 0) reach it."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.extend(int(v) for v in x[:, 0].tolist())
        return self.linear(x)


def _build(seen: list[int]) -> tuple:
    import zerodist
    from zerodist.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [Recorder(seen), torch.nn.Linear(WIDTH, WIDTH)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss)
    data = [(torch.tensor([float(i)] + [0.0] * (WIDTH - 1)), torch.zeros(WIDTH)) for i in range(SAMPLES)]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = zerodist.initialize(model=model, config=config, training_data=data)
    return engine, data


def _surface_and_order() -> dict:
    seen: list[int] = []
    engine, data = _build(seen)
    facts = {"stage_id": engine.stage_id, "num_stages": engine.num_stages, "grid_stage": engine.grid.get_stage_id(),
             "grid_pipe": engine.grid.get_pipe_parallel_world_size(), "first": engine.grid.is_first_stage,
             "dp": engine.grid.get_data_parallel_world_size()}
    for _ in range(4):  # 4 x 4 samples over 12: past the end of the data, into its second pass
        engine.train_batch()
    facts["seen"] = list(seen)
    seen.clear()
    custom = iter([(torch.full((MICRO, WIDTH), 100.0 + k), torch.zeros(MICRO, WIDTH)) for k in range(GAS)])
    engine.set_dataiterator(custom)
    engine.train_batch()
    facts["seen_after_set"] = list(seen)
    engine.destroy()
    return facts


def test_pipeline_engine_surface_and_deepspeeds_data_order():
    results = run_distributed(_surface_and_order, 2, timeout=120)
    for rank, facts in enumerate(results):
        assert (facts["stage_id"], facts["num_stages"], facts["grid_stage"], facts["grid_pipe"]) == (rank, 2, rank, 2)
        assert facts["first"] == (rank == 0) and facts["dp"] == 1
    # Stage 0 read the samples in dataset order, and again from the start on the second pass.
    assert results[0]["seen"] == list(range(SAMPLES)) + list(range(4))
    assert results[0]["seen_after_set"] == [100] * MICRO + [101] * MICRO


def _set_dataiterator_without_training_data() -> float:
    """DeepSpeed's gradient-accumulation test, in our words: two 1x1 layers at 1.0, SGD lr 0.1, GAS 2,
    MSE of ones against zeros: the first weight becomes 1 - 2 x 0.1 (the gradient is scaled once)."""
    import zerodist
    from zerodist.pipe import PipelineModule
    from zerodist.utils import RepeatingLoader

    layers = [torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)]
    for layer in layers:
        torch.nn.init.ones_(layer.weight)
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10**9}
    engine, *_ = zerodist.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.set_dataiterator(RepeatingLoader([(torch.ones(1, 1), torch.zeros(1, 1))]))
    engine.train_batch()
    weight = float(next(engine.module.parameters()).item())
    engine.destroy()
    return weight


def test_set_dataiterator_feeds_train_batch_without_training_data():
    weights = run_distributed(_set_dataiterator_without_training_data, 2, timeout=120)
    assert weights == [pytest.approx(1.0 - 2.0 * 0.1, abs=1e-6)] * 2
