"""Two pipeline stages on one rank (pipe degree 1) through `initialize` / `train_batch` on gloo, the
CPU run of the GPU tier's one-device pipeline (tests/pipe/one_rank_pipeline.py): equal to one plain
loop of gradient accumulation within 1e-6 (fp64 1e-12), the micro-batches' CPU tensors moved to the
rank's device by the executor."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.pipe.one_rank_pipeline import check, one_rank_pipeline


@pytest.mark.parametrize("schedule,dtype_name", [("interleaved", "float32"), ("zbv", "float32"),
                                                 ("interleaved", "float64")])
def test_two_stages_on_one_rank_equal_a_plain_loop(schedule, dtype_name):
    result = run_distributed(one_rank_pipeline, 1, schedule, dtype_name, timeout=120)[0]
    assert result["backend"] == "gloo" and result["devices"] == ["cpu"]
    check(result, dtype_name)
