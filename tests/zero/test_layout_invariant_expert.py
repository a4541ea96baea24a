"""The layout-invariant mode with expert parallelism (issue 35, docs/determinism.md): the MoE GPT
(4 experts, top-1, capacity) over 2 expert ranks at ZeRO 0, 1, 2 and 3, and over 4 expert ranks,
AdamW with clipping active, 10 steps: parameters (experts gathered under their global ids), the
dense parameters' AdamW state and the per-step losses torch.equal to one process (ep_size 1) x 8
micro-batches. [Note: experts in the mode] in zerodist/moe/ordered.py."""

from __future__ import annotations

import functools

import pytest

import torch

import zerodist
from tests.harness import run_distributed
from tests.zero.layout_invariant_helpers import assert_bitwise, mode_config, train_in_mode
from zerodist.models import gpt_config
from zerodist.models.moe_gpt import MoEConfig, MoEGPT
from zerodist.pipe import split_model
from zerodist.zero.canonical import LayoutInvariantError, check_layout

STEPS = 10


BF16 = {"bf16": {"enabled": True}}


@functools.cache
def reference(bf16: bool = False) -> dict:
    result = run_distributed(train_in_mode, 1, 0, STEPS, "moe", timeout=240, **(BF16 if bf16 else {}))[0]
    assert result["clipped_steps"] > 0, "the test needs gradient clipping active"
    return result


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_2_is_bitwise_one_process(stage):
    for result in run_distributed(train_in_mode, 2, stage, STEPS, "moe-ep2", timeout=240):
        assert_bitwise(result, reference())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_expert_4_on_4_ranks_is_bitwise_one_process(stage):
    """One expert per rank: each expert's 4 per-source gradients by the tree (autograd alone would add
    them in its own order)."""
    for result in run_distributed(train_in_mode, 4, stage, STEPS, "moe-ep4", timeout=300):
        assert_bitwise(result, reference())


@pytest.mark.slow
def test_bf16_expert_2_is_bitwise_one_process():
    for result in run_distributed(train_in_mode, 2, 1, STEPS, "moe-ep2", timeout=240, **BF16):
        assert_bitwise(result, reference(bf16=True))


@pytest.mark.unit
def test_expert_layouts_the_mode_cannot_order_are_refused_by_name():
    with pytest.raises(LayoutInvariantError, match="expert-parallel degree 3 is not a power of two"):
        check_layout(data_degree=1, accumulation=4, stage=1, pipe=1, sequence=1, expert=3, fp16=False)
    with pytest.raises(LayoutInvariantError, match="expert with pipeline parallelism"):
        check_layout(data_degree=1, accumulation=4, stage=1, pipe=2, sequence=1, expert=2, fp16=False)
    check_layout(data_degree=1, accumulation=2, stage=1, pipe=1, sequence=1, expert=4, fp16=False)
    check_layout(data_degree=2, accumulation=2, stage=0, pipe=1, sequence=1, expert=2, fp16=False)


def _refused_everywhere(experts: int, pipe: int) -> str:
    """The MoE GPT with `experts` experts over every rank of a stage (`pipe` stages) in the mode."""
    torch.manual_seed(0)
    ep = torch.distributed.get_world_size() // pipe
    model: torch.nn.Module = MoEGPT(gpt_config("tiny"), MoEConfig(num_experts=experts, ep_size=ep))
    if pipe > 1:
        model = split_model(model, num_stages=pipe)
    try:
        zerodist.initialize(model=model, config=mode_config(1, 4))
    except LayoutInvariantError as error:
        return str(error)
    return "initialized"


@pytest.mark.slow
def test_expert_layouts_the_mode_refuses_are_refused_on_every_rank_before_any_collective():
    for message in run_distributed(_refused_everywhere, 3, 3, 1, timeout=120):
        assert "the expert-parallel degree 3 is not a power of two" in message, message
    for message in run_distributed(_refused_everywhere, 4, 2, 2, timeout=180):
        assert "expert with pipeline parallelism" in message, message
