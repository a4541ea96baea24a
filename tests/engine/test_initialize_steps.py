"""What the configuration says runs: overlap_comm both ways, refused values with their reasons,
and the collective the initialize line names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist.comm as comm
from tests.engine_helpers import base_config, global_batch, train_distributed
from tests.harness import distributed_test
from zerodist.config import Config, ConfigError
from zerodist.engine.initialize import reduce_collective
from zerodist.zero.policy import ShardingPolicy


@pytest.mark.unit
@pytest.mark.parametrize("raw, message", [
    ({"tensor_parallel": {"autotp_size": 2}, "zerodist": {"tensor_parallel": {"size": 4}}},
     "'tensor_parallel.autotp_size' \\(2\\) and 'zerodist.tensor_parallel.size' \\(4\\) disagree"),
])
def test_values_asking_for_what_zerodist_lacks_are_refused_with_the_reason(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(raw)


@pytest.mark.unit
def test_deepspeed_defaults_for_those_keys_load():
    config = Config.load({"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True,
                                                "stage3_gather_16bit_weights_on_model_save": True},
                          "tensor_parallel": {"autotp_size": 1}})
    assert config.zero_optimization.overlap_comm and config.tensor_parallel.autotp_size == 1


@pytest.mark.unit
def test_contiguous_gradients_false_is_accepted_as_changing_nothing_in_one_info_line(caplog):
    # DeepSpeed's own ZeRO tests and some shipped configs set it false: a memory layout, same gradients
    with caplog.at_level("INFO", logger="zerodist"):
        config = Config.load({"zero_optimization": {"stage": 2, "contiguous_gradients": False}})
    assert config.zero_optimization.contiguous_gradients and config.zero_optimization.stage == 2
    assert "zero_optimization.contiguous_gradients=false" in caplog.text


@pytest.mark.unit
def test_the_log_names_the_collective_that_runs():
    assert reduce_collective(ShardingPolicy.from_stage(0), True) == "all-reduce (reduce_scatter applies from stage 1)"
    assert reduce_collective(ShardingPolicy.from_stage(0), False) == "all-reduce"
    assert reduce_collective(ShardingPolicy.from_stage(2), True) == "reduce-scatter"
    assert reduce_collective(ShardingPolicy.from_stage(3), False) == "all-reduce"


def _reductions_before_backward_ends(overlap: bool, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Collectives issued before the first layer's weight gradient (the last one backward makes)."""
    config = base_config(stage, zero_optimization={"overlap_comm": overlap, "reduce_bucket_size": 300,
                                                   "allgather_bucket_size": 300})
    engine, state = train_distributed(config, 2)
    first = engine.module[0].weight
    seen: list[int] = []
    with comm.trace() as trace:
        handle = first.register_hook(lambda grad: seen.append(len(trace.records)))
        x, y = global_batch(9, 4 * comm.get_world_size())
        rows = slice(4 * comm.get_rank(), 4 * comm.get_rank() + 4)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        handle.remove()
    assert len(engine.reducer.order) > 2 and len(trace.records) >= len(engine.reducer.order)
    engine.step()
    return seen[0], engine.module_state_dict()


@pytest.mark.parametrize("stage", [0, 2])
@distributed_test(world_size=2)
def test_overlap_comm_false_reduces_after_backward_with_the_same_result(stage):
    during, overlapped = _reductions_before_backward_ends(True, stage)
    after, deferred = _reductions_before_backward_ends(False, stage)
    assert during > 0 and after == 0
    for key, value in overlapped.items():
        assert torch.equal(value, deferred[key]), key
