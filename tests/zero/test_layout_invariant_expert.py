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
@pytest.mark.parametrize("stage", [1, 3])
def test_expert_2_by_data_2_on_4_ranks_is_bitwise_one_process(stage):
    """Two expert groups of two ranks: each expert's block sums, then the expert-data reduction over the groups."""
    for result in run_distributed(train_in_mode, 4, stage, STEPS, "moe-ep2", timeout=300):
        assert_bitwise(result, reference())


@pytest.mark.slow
def test_bf16_expert_2_is_bitwise_one_process():
    for result in run_distributed(train_in_mode, 2, 1, STEPS, "moe-ep2", timeout=240, **BF16):
        assert_bitwise(result, reference(bf16=True))


@pytest.mark.unit
def test_expert_layouts_the_mode_cannot_order_are_refused_by_name():
    with pytest.raises(LayoutInvariantError, match="expert-parallel degree 3 is not a power of two"):
        check_layout(data_degree=1, accumulation=4, stage=1, pipe=1, sequence=1, expert=3, fp16=False)
    with pytest.raises(LayoutInvariantError, match="experts with the 'interleaved' pipeline schedule"):
        check_layout(data_degree=1, accumulation=4, stage=1, pipe=2, sequence=1, expert=2, fp16=False,
                     schedule="interleaved")
    check_layout(data_degree=1, accumulation=4, stage=3, pipe=2, sequence=1, expert=2, fp16=False, schedule="zb")
    check_layout(data_degree=1, accumulation=2, stage=1, pipe=1, sequence=1, expert=4, fp16=False)
    check_layout(data_degree=2, accumulation=2, stage=0, pipe=1, sequence=1, expert=2, fp16=False)
    # all of a pipeline's stages on one rank (pipe degree 1) is still a pipeline
    with pytest.raises(LayoutInvariantError, match="experts with the 'interleaved' pipeline schedule"):
        check_layout(data_degree=2, accumulation=4, stage=2, pipe=1, sequence=1, expert=2, fp16=False,
                     schedule="interleaved", pipeline=True)


def _refused_everywhere(experts: int, pipe: int, split: bool = False) -> str:
    """The MoE GPT with `experts` experts over every rank of a stage (`pipe` stages; interleaved) in the mode;
    `split`: cut into a pipeline also at `pipe` 1 (both its stages on every rank)."""
    torch.manual_seed(0)
    ep = torch.distributed.get_world_size() // pipe
    model: torch.nn.Module = MoEGPT(gpt_config("tiny", n_layers=4), MoEConfig(num_experts=experts, ep_size=ep))
    if pipe > 1 or split:
        model = split_model(model, num_stages=pipe, stages_per_rank=2)
    try:
        zerodist.initialize(model=model, config=mode_config(1, 4, zerodist={"pipeline": {"schedule": "interleaved"}}))
    except LayoutInvariantError as error:
        return str(error)
    return "initialized"


@pytest.mark.slow
def test_expert_layouts_the_mode_refuses_are_refused_on_every_rank_before_any_collective():
    for message in run_distributed(_refused_everywhere, 3, 3, 1, timeout=120):
        assert "the expert-parallel degree 3 is not a power of two" in message, message
    for message in run_distributed(_refused_everywhere, 4, 2, 2, timeout=180):
        assert "experts with the 'interleaved' pipeline schedule" in message, message


@pytest.mark.slow
def test_one_rank_interleaved_pipeline_with_experts_is_refused_by_name():
    """Pipe degree 1, both stages on every rank (expert 2): a pipeline all the same."""
    for message in run_distributed(_refused_everywhere, 2, 2, 1, True, timeout=120):
        assert "experts with the 'interleaved' pipeline schedule" in message, message


def _pipelined_moe(stage: int, schedule: str, steps: int = STEPS, num_stages: int = 2) -> dict:
    """The MoE GPT cut by split_model into pipe `num_stages` (2: 4 ranks; 1: the whole model one stage on each
    of 2 ranks), each stage's experts over expert 2, accumulation 4, fed by the mode's contiguous rule (a
    pipeline reduces once per step, also at pipe degree 1)."""
    from tests.zero.layout_invariant_helpers import MICROS, global_tokens, logical_optimizer_state, make_model
    from zerodist.zero.canonical import micro_batch_index

    model, vocab, seq = make_model("moe-ep2")
    config = mode_config(stage, MICROS // 2, zerodist={"pipeline": {"schedule": schedule}})
    engine = zerodist.initialize(model=split_model(model, num_stages=num_stages), config=config)[0]
    shards, rank = engine.topology.num_batch_shards, engine.topology.batch_rank
    losses = []
    for step in range(steps):
        tokens = global_tokens(step, vocab, seq)
        mine = [tokens[k * 2: (k + 1) * 2] for k in (micro_batch_index(rank, j, shards, MICROS // shards, False)
                                                      for j in range(MICROS // shards))]
        losses.append(engine.train_batch(iter([(rows[:, :-1], rows[:, 1:]) for rows in mine])))
    optimizer = {k: v for k, v in logical_optimizer_state(engine).items() if "experts" not in k}
    result = {"params": engine.module_state_dict(), "optimizer": optimizer, "losses": torch.stack(losses)}
    engine.destroy()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("stage,schedule", [(1, "1f1b"), (1, "zb"), (1, "gpipe"), (3, "1f1b")])
def test_pipe_2_by_expert_2_is_bitwise_one_process(stage, schedule):
    expected = reference()
    _assert_pipelined_bitwise(run_distributed(_pipelined_moe, 4, stage, schedule, timeout=300), expected)


@pytest.mark.slow
def test_one_rank_pipeline_by_expert_2_is_bitwise_one_process():
    """split_model(num_stages=1) on 2 ranks (pipe degree 1, expert 2) at ZeRO 2: the experts deal the
    micro-batches contiguously like the sampler and the pipeline's one reduction, not interleaved as
    ZeRO 2 without a pipeline does."""
    expected = reference()
    _assert_pipelined_bitwise(run_distributed(_pipelined_moe, 2, 2, "1f1b", STEPS, 1, timeout=300), expected)


def _assert_pipelined_bitwise(results: list[dict], expected: dict) -> None:
    for result in results:
        differing = [k for k, v in result["params"].items() if not torch.equal(v, expected["params"][k])]
        assert not differing, differing[:5]
        differing = [k for k, v in result["optimizer"].items() if not torch.equal(v, expected["optimizer"][k])]
        assert not differing, differing[:5]
        assert torch.equal(result["losses"], expected["losses"]), (result["losses"], expected["losses"])
    assert set().union(*(r["params"] for r in results)) == expected["params"].keys()
