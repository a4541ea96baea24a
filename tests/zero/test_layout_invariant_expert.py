"""The layout-invariant mode with expert parallelism (issue 35, docs/determinism.md): the MoE GPT
(4 experts, top-1, capacity) over 2 expert ranks at ZeRO 2 and 3, AdamW with clipping active, 10
steps: parameters (experts gathered under their global ids), the dense parameters' AdamW state
and the per-step losses torch.equal to one process (ep_size 1) x 8 micro-batches.
[Note: experts in the mode] in zerodist/zero/canonical.py."""

from __future__ import annotations

import functools

import pytest

from tests.harness import run_distributed
from tests.zero.layout_invariant_helpers import assert_bitwise, train_in_mode
from zerodist.zero.canonical import LayoutInvariantError, check_layout

STEPS = 10


@functools.cache
def reference() -> dict:
    result = run_distributed(train_in_mode, 1, 0, STEPS, "moe", timeout=240)[0]
    assert result["clipped_steps"] > 0, "the test needs gradient clipping active"
    return result


@pytest.mark.parametrize("stage", [2, 3])
def test_expert_2_is_bitwise_one_process(stage):
    for result in run_distributed(train_in_mode, 2, stage, STEPS, "moe-ep2", timeout=240):
        assert_bitwise(result, reference())


@pytest.mark.unit
def test_expert_layouts_the_mode_cannot_order_are_refused_by_name():
    with pytest.raises(LayoutInvariantError, match="expert parallelism at ZeRO stage 0/1.*use ZeRO stage 2 or 3"):
        check_layout(data_degree=1, accumulation=4, stage=1, pipe=1, sequence=1, expert=2, fp16=False)
    with pytest.raises(LayoutInvariantError, match="expert parallelism of degree 4"):
        check_layout(data_degree=1, accumulation=2, stage=3, pipe=1, sequence=1, expert=4, fp16=False)
    check_layout(data_degree=2, accumulation=2, stage=2, pipe=1, sequence=1, expert=2, fp16=False)
