"""TRL's GRPO, unmodified, trains on zerodist at ZeRO-2 and ZeRO-3 with DDP's losses and rewards. At ZeRO-3
TRL generates inside a whole-model gather and takes DeepSpeed's stage-3 hooks off and on around it
through DeepSpeed's optimizer internals; the served `trl.models.utils` leaves a zerodist engine as it is
([Note: TRL's generation under the served ZeRO-3] in zerodist/integrations/trl_zero3.py). Needs TRL."""

from __future__ import annotations

import types

import pytest

from tests.integrations.trl_common import launch
from zerodist.integrations import trl_zero3


@pytest.mark.unit
def test_the_generation_hooks_leave_a_zerodist_engine_alone_and_call_trls_for_others():
    from zerodist.engine import Engine

    calls = []
    module = types.ModuleType("fake_trl_models_utils")
    module.remove_hooks = lambda model: calls.append(("remove", model))  # type: ignore[attr-defined]
    module.add_hooks = lambda model: calls.append(("add", model))  # type: ignore[attr-defined]
    trl_zero3.replace_generation_hooks(module)
    trl_zero3.replace_generation_hooks(module)  # once only
    engine = Engine.__new__(Engine)  # the type is all the hooks read
    module.remove_hooks(engine)
    module.add_hooks(engine)
    assert calls == []
    other = object()
    module.remove_hooks(other)
    module.add_hooks(other)
    assert calls == [("remove", other), ("add", other)]


@pytest.mark.slow
def test_trl_grpo_trains_at_zero_2_and_3_with_ddps_losses_and_rewards(tmp_path):
    pytest.importorskip("trl", minversion="1.0")
    pytest.importorskip("datasets")
    ddp = launch("trl_grpo_script.py", tmp_path / "ddp", None)
    assert ddp["model"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    for stage in (2, 3):
        served = launch("trl_grpo_script.py", tmp_path / f"zero{stage}", stage)
        assert served["model"] == served["reference"] == "zerodist.engine.engine.Engine"
        assert len(served["losses"]) == 3
        assert served["rewards"] == ddp["rewards"], stage  # the same completions were sampled
        assert served["losses"] == pytest.approx(ddp["losses"], abs=1e-5), stage
