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


def _engine(stage: int, bf16: bool, nvme_path: str, offload_param: bool = False):
    import zerodist
    from zerodist.models import make_mlp

    config: dict = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "sub_group_size": 4096, "reduce_bucket_size": 20_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                                          "buffer_count": 2}}}
    if offload_param:  # every parameter sharded (none kept whole as persistent), so the formula's N applies
        config["zero_optimization"] |= {"offload_param": {"device": "nvme"}, "stage3_param_persistence_threshold": 0}
    return zerodist.initialize(model=make_mlp(64, 120, 8, layers=3), config=config)[0]


@pytest.mark.parametrize("bf16", [False, True])
@distributed_test(world_size=2, timeout=120)
def test_estimate_equals_measured_memory_and_disk_with_nvme_offload(bf16):
    from zerodist.cli.main import main
    from zerodist.debug import estimate_for_engine, memory_report, padded_num_params

    nvme = "/tmp"
    for stage, offload_param in ((1, False), (2, False), (3, False), (3, True)):
        engine = _engine(stage, bf16, nvme, offload_param)
        try:
            generator = torch.Generator().manual_seed(engine.global_rank)
            engine.backward(F.mse_loss(engine(torch.randn(2, 64, generator=generator)).float(), torch.zeros(2, 8)))
            engine.step()
            measured = engine.model_state_bytes()
            estimate = estimate_for_engine(engine)
            # The fp32 master (bf16) is in the swap files too: no optimizer state left in memory.
            assert estimate.optimizer_states == measured["optimizer"] == 0
            if offload_param:  # and no parameter shard
                assert estimate.parameters == measured["params"] == 0
            if stage < 3 or offload_param:  # stage 3 keeps parameters this small whole (persistent) unless told
                assert estimate.model_states == measured["total"]
                assert "(exact)" in memory_report(engine).format()
            on_disk = engine.zero_state.optimizer.swapped_state_bytes()
            files = len(list(engine.zero_state.inner_optimizer.directory.path.glob("*.swp")))
            per_element = 12 if bf16 or offload_param else 8  # Adam's states, and the master or the fp32 shard
            assert estimate.disk == per_element * estimate.num_params // 2 <= on_disk <= estimate.disk + 3 * 64 * files
            report = memory_report(engine).format()
            assert "on disk (swap files)" in report and "on disk)" in report
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(["estimate", "--params", str(padded_num_params(engine)), "--world-size", "2", "--stage",
                      str(stage), "--dtype", "bf16" if bf16 else "fp32", "--offload-optimizer", "nvme",
                      "--sub-group-size", "4096", "--buffer-count", "2", "--offload-param",
                      "nvme" if offload_param else "none"])
            assert formula(stage, "bf16" if bf16 else "fp32", "adam", "nvme",
                           "nvme" if offload_param else "none") in out.getvalue()
        finally:
            engine.destroy()


@pytest.mark.unit
def test_estimate_moves_adam_state_to_disk_and_counts_the_buffers():
    plain = estimate_memory(29_000_000, world_size=2, stage=2)
    swapped = estimate_memory(29_000_000, world_size=2, stage=2, offload_optimizer="nvme", sub_group_size=5e5)
    assert plain.optimizer_states - swapped.optimizer_states == swapped.disk == 8 * 14_500_000
    assert swapped.swap_buffers == 4 * 500_000 * 8
    assert formula(2, "fp32", "adam", "nvme") == "4Ψ + 4Ψ/N (+ 8Ψ/N on disk)"
    assert formula(1, "bf16", "adam", "nvme") == "4Ψ (+ 12Ψ/N on disk)"  # the fp32 master is swapped too
    assert formula(3, "fp32", "adam", "nvme", "nvme") == "4Ψ/N (+ 12Ψ/N on disk)"
    assert formula(3, "bf16", "adam", "nvme", "nvme") == "2Ψ/N (+ 12Ψ/N on disk)"
    both = estimate_memory(29_000_000, world_size=2, stage=3, offload_optimizer="nvme", offload_param="nvme",
                           sub_group_size=5e5)
    assert both.parameters == 0 and both.disk == 12 * 14_500_000 and both.swap_buffers == 4 * 500_000 * 12
    with pytest.raises(ValueError, match="offload_param nvme needs offload_optimizer nvme"):
        estimate_memory(1000, world_size=2, stage=3, offload_optimizer="cpu", offload_param="nvme")
    below_3 = estimate_memory(1000, world_size=2, stage=2, offload_optimizer="nvme", offload_param="nvme")
    assert below_3 == estimate_memory(1000, world_size=2, stage=2, offload_optimizer="nvme")  # stage 3 only
    assert estimate_memory(1000, world_size=2, stage=0, offload_optimizer="nvme").disk == 0  # stage 0: no offload
