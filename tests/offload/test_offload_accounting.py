"""Memory accounting with swapped optimizer state: the engine's model states, the estimate and
`zerodist estimate` agree on what is in memory and what is on disk."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F

from zerodist.debug.estimate import estimate_memory, formula
from tests.harness import distributed_test


def _engine(stage: int, bf16: bool, nvme_path: str):
    import zerodist
    from zerodist.models import make_mlp

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "sub_group_size": 4096, "reduce_bucket_size": 20_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                                          "buffer_count": 2}}}
    return zerodist.initialize(model=make_mlp(64, 120, 8, layers=3), config=config)[0]


@pytest.mark.parametrize("bf16", [False, True])
@distributed_test(world_size=2, timeout=120)
def test_estimate_equals_measured_memory_and_disk_with_nvme_offload(bf16):
    from zerodist.cli.main import main
    from zerodist.debug import estimate_for_engine, memory_report, padded_num_params

    nvme = "/tmp"
    for stage in (1, 2, 3):
        engine = _engine(stage, bf16, nvme)
        try:
            generator = torch.Generator().manual_seed(engine.global_rank)
            engine.backward(F.mse_loss(engine(torch.randn(2, 64, generator=generator)).float(), torch.zeros(2, 8)))
            engine.step()
            measured = engine.model_state_bytes()
            estimate = estimate_for_engine(engine)
            assert estimate.optimizer_states == measured["optimizer"] == (4 * estimate.num_params // 2 if bf16 else 0)
            if stage < 3:  # stage 3 keeps parameters this small whole (persistent): the formula's N does not apply
                assert estimate.model_states == measured["total"]
                assert "(exact)" in memory_report(engine).format()
            on_disk = engine.zero_state.optimizer.swapped_state_bytes()
            files = len(list(engine.zero_state.inner_optimizer.directory.path.glob("*.swp")))
            assert estimate.disk == 8 * estimate.num_params // 2 <= on_disk <= estimate.disk + 2 * 64 * files
            report = memory_report(engine).format()
            assert "on disk (swap files)" in report and "on disk)" in report
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(["estimate", "--params", str(padded_num_params(engine)), "--world-size", "2", "--stage",
                      str(stage), "--dtype", "bf16" if bf16 else "fp32", "--offload-optimizer", "nvme",
                      "--sub-group-size", "4096", "--buffer-count", "2"])
            assert formula(stage, "bf16" if bf16 else "fp32", "adam", "nvme") in out.getvalue()
        finally:
            engine.destroy()


@pytest.mark.unit
def test_estimate_moves_adam_state_to_disk_and_counts_the_buffers():
    plain = estimate_memory(29_000_000, world_size=2, stage=2)
    swapped = estimate_memory(29_000_000, world_size=2, stage=2, offload_optimizer="nvme", sub_group_size=5e5)
    assert plain.optimizer_states - swapped.optimizer_states == swapped.disk == 8 * 14_500_000
    assert swapped.swap_buffers == 4 * 500_000 * 8
    assert formula(2, "fp32", "adam", "nvme") == "4Ψ + 4Ψ/N (+ 8Ψ/N on disk)"
    assert formula(1, "bf16", "adam", "nvme") == "4Ψ + 4Ψ/N (+ 8Ψ/N on disk)"
    assert estimate_memory(1000, world_size=2, stage=0, offload_optimizer="nvme").disk == 0  # stage 0: no offload
