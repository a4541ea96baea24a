"""TRL's SFT with a PEFT LoRA adapter, unmodified, trains on zerodist at ZeRO-2 and ZeRO-3 with DDP's
losses, and at ZeRO-3 each rank holds half of the frozen base model ([Note: frozen parameters at stage 3]
in zerodist/zero/apply.py), as DeepSpeed partitions it. Needs TRL and PEFT (skipped without them; not in
the test extras)."""

from __future__ import annotations


import pytest

from tests.integrations.trl_common import launch


@pytest.mark.slow
def test_trl_sft_with_lora_trains_at_zero_2_and_3_with_ddps_losses_and_the_base_sharded(tmp_path):
    pytest.importorskip("trl", minversion="1.0")
    pytest.importorskip("peft")
    pytest.importorskip("datasets")
    ddp = launch("trl_sft_lora_script.py", tmp_path / "ddp", None)
    assert ddp["model"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert len(ddp["losses"]) == 4
    for stage in (2, 3):
        served = launch("trl_sft_lora_script.py", tmp_path / f"zero{stage}", stage)
        assert served["model"] == "zerodist.engine.engine.Engine"
        assert served["losses"] == pytest.approx(ddp["losses"], abs=1e-5), stage
        if stage == 3:  # the two decoder layers and the root
            assert served["frozen_groups"] == 3
            assert served["frozen_held"] < 0.51 * served["frozen"]
        else:
            assert served["frozen_groups"] == 0
