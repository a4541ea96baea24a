"""`offload_param: nvme` in a pipeline (pipe 2 x data 2, ZeRO 3): the first stage's layers are
gathered from shards read out of the swap files, the last stage's are small enough to stay whole
(persistent), so only the first stage reads shards before its gathers. Those reads agree on
failure over the stage's own ranks; agreed over the whole world they would wait for collectives
the other stage never issues. Parameters end bitwise equal to the same pipeline in memory."""

from __future__ import annotations

import torch

import zerodist
from tests.harness import run_distributed
from zerodist.pipe import PipelineModule

WIDE, NARROW, MICRO, GAS, STEPS = 64, 8, 4, 4, 3


def _layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    wide = [torch.nn.Sequential(torch.nn.Linear(WIDE, WIDE), torch.nn.Tanh()) for _ in range(4)]
    narrow = [torch.nn.Sequential(torch.nn.Linear(WIDE, NARROW), torch.nn.Tanh()),
              *[torch.nn.Sequential(torch.nn.Linear(NARROW, NARROW), torch.nn.Tanh()) for _ in range(2)],
              torch.nn.Linear(NARROW, NARROW)]
    return [*wide, *narrow]  # 4160 parameters a layer on the first stage, at most 520 on the last


def _train(nvme_path: str | None) -> dict[str, torch.Tensor]:
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 1000, "sub_group_size": 2048}
    if nvme_path is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
        zero["offload_param"] = {"device": "nvme"}
    module = PipelineModule(_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, _, _, _ = zerodist.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "zero_optimization": zero,
        "zerodist": {"stage3_unit_classes": ["Linear"]}})
    data_rank = engine.topology.axis_rank("data")
    for step in range(STEPS):
        batches = []
        for micro in range(GAS):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
            batches.append((torch.randn(MICRO, WIDE, generator=g), torch.randn(MICRO, NARROW, generator=g)))
        engine.train_batch(iter(batches))
    state = engine.module_state_dict()
    engine.destroy()
    return state


def test_offload_param_in_a_pipeline_is_bitwise_the_in_memory_pipeline(tmp_path):
    in_memory = run_distributed(_train, 4, None, timeout=120)
    offloaded = run_distributed(_train, 4, str(tmp_path), timeout=120)
    for expected, got in zip(in_memory, offloaded):
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
