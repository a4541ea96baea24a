"""TRL's DPO, unmodified, trains on zerodist at ZeRO-2 and ZeRO-3 with DDP's losses. Its reference model
is prepared by TRL itself with `deepspeed.initialize` and no optimizer: at ZeRO-2 as stage 0, at ZeRO-3 with
the dotted bucket keys TRL adds ([Note: dotted keys] in zerodist/config/dotted_keys.py), which zerodist
refused until it read them. Needs TRL (skipped without it; not in the test extras)."""

from __future__ import annotations


import pytest

from tests.integrations.trl_common import launch

SYNC = {False: (), True: ("--sync-reference",)}


@pytest.mark.slow
@pytest.mark.parametrize("sync", [False, True], ids=["fixed-reference", "synced-reference"])
def test_trl_dpo_with_a_reference_model_trains_at_zero_2_and_3_with_ddps_losses(tmp_path, sync):
    """With `sync_ref_model` TRL writes the reference's parameters under `GatheredParameters(...,
    modifier_rank=0)` every 2 steps (the losses of steps 3 and 4 change with it)."""
    pytest.importorskip("trl", minversion="1.0")
    pytest.importorskip("datasets")
    ddp = launch("trl_dpo_script.py", tmp_path / "ddp", None, *SYNC[sync])
    assert ddp["reference"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert ddp["model"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    for stage, reference_stage in ((2, 0), (3, 3)):  # TRL runs its reference at stage 0 unless the run is at 3
        served = launch("trl_dpo_script.py", tmp_path / f"zero{stage}", stage, *SYNC[sync])
        assert served["model"] == served["reference"] == "zerodist.engine.engine.Engine"
        assert served["reference_stage"] == reference_stage
        assert len(served["losses"]) == 4
        assert served["losses"] == pytest.approx(ddp["losses"], abs=1e-5), stage
