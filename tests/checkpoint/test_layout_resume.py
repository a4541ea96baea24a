"""Any layout resumes into any other (issue 31 item 5): a checkpoint saved under one composition of
axes loads under another, parameters and optimizer state, with no offline conversion, and the next
steps equal the uninterrupted run (the saving layout training on) within 1e-6. AdamW throughout,
so a lost or misplaced moment would show in the resumed steps.

- a tiny Hugging Face Llama (4 query over 2 key/value heads), cut by `split_model` and trained at
  pipe 2 x tensor 2 x data 1, ZeRO 1, resumes at data 4 (ZeRO 3) and at sequence 2 x data 2
  (Ulysses, ZeRO 2): one global batch of 4 micro-batches per step in every layout, the mean token
  loss over it;
- the demo MoE GPT at expert 2 x data 2, ZeRO 2, resumes at expert 1 x data 1 (one process,
  ZeRO 1), each micro-batch seen whole by one rank in both (capacity and the balance loss are
  statistics of a rank's own tokens).

Besides the trajectory, the resumed engine saves again at once: its consolidated parameters and
Adam moments equal the saved ones bitwise (the reshard itself moves values, never computes them).
"""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, MICRO, SEQ, VOCAB, build, micro_batch
from zerodist.pipe import split_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SAVE_AT, AFTER = 3, 3
KINDS = ("param", "optimizer.exp_avg", "optimizer.exp_avg_sq")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}}


def _config(stage: int, gas: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
            "optimizer": ADAMW, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **extra}


def _llama(scramble: bool = False) -> torch.nn.Module:
    model = build("llama-kv2")
    if scramble:  # other weights: the checkpoint must replace every value
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.5, 0.5)
    return model


# ---------------------------------------------------------------- pipe 2 x tensor 2 -> data 4, sequence 2 x data 2

def pipe_tensor_save_body(path: str):
    """Saves at step 3, then trains on: the uninterrupted run (each rank's stage, logical names)."""
    module = split_model(_llama(), num_stages=2, split_points=["model.layers.1"])
    config = _config(1, GAS, tensor_parallel={"autotp_size": 2}, zerodist={"pipeline": {"schedule": "1f1b"}})
    engine = zerodist.initialize(model=module, config=config)[0]
    assert dict(engine.topology.degrees) == {"pipe": 2, "data": 1, "expert": 1, "sequence": 1, "tensor": 2}
    states = []
    for step in range(SAVE_AT + AFTER):
        if step == SAVE_AT:
            engine.save_checkpoint(path)
        engine.train_batch(iter([micro_batch(step, m, 0) for m in range(GAS)]))
        states.append(engine.module_state_dict())
    engine.destroy()
    return states


def _hf_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    """Micro-batch `micro` of the pipeline's global batch, for the model's own loss: the next tokens
    as `shift_labels` (so that a sequence slice needs no shifting), the same token mean."""
    inputs, targets = micro_batch(step, micro, 0)
    targets = targets.contiguous()  # Hugging Face's loss views them flat
    return {"input_ids": inputs, "labels": targets, "shift_labels": targets}


def plain_resume_body(path: str, again: str, sequence: int, stage: int):
    """data 4 (sequence 1) or sequence 2 x data 2: micro-batch g * data + d on data rank d."""
    from zerodist.sequence import SequenceLayout
    from zerodist.sequence.data import shard_batch

    data = 4 // sequence
    extra = {"sequence_parallel_size": sequence} if sequence > 1 else {}
    engine = zerodist.initialize(model=_llama(scramble=True), config=_config(stage, GAS // data, **extra))[0]
    assert engine.topology.degrees["data"] == data and engine.topology.degrees["sequence"] == sequence
    engine.load_checkpoint(path)
    assert engine.global_steps == SAVE_AT
    engine.save_checkpoint(again)
    layout = SequenceLayout(engine.topology.axis_rank("sequence"), sequence) if sequence > 1 else None
    shard, states = engine.topology.batch_rank, []
    for step in range(SAVE_AT, SAVE_AT + AFTER):
        for g in range(GAS // data):
            batch = _hf_batch(step, g * data + shard)
            engine.backward(engine(**(shard_batch(batch, layout) if layout else batch)).loss)
            engine.step()
        states.append(engine.module_state_dict())
    engine.destroy()
    return states


def _merged(results: list) -> list[dict[str, torch.Tensor]]:
    """Per step, the union of every rank's state (pipeline ranks hold their own stage's keys)."""
    merged: list[dict[str, torch.Tensor]] = [{} for _ in results[0]]
    for states in results:
        for step, state in enumerate(states):
            merged[step].update(state)
    return merged


def _assert_same_state(path, again) -> None:
    for kind in KINDS:
        before, after = ckpt.consolidate_checkpoint(path, kind=kind), ckpt.consolidate_checkpoint(again, kind=kind)
        assert before.keys() == after.keys(), kind
        for key in before:
            assert torch.equal(after[key], before[key]), f"{kind} of {key} changed in the reshard"


def _assert_resumed(resumed: list[dict[str, torch.Tensor]], uninterrupted: list[dict[str, torch.Tensor]]) -> None:
    assert len(resumed) == AFTER
    for step, (state, expected) in enumerate(zip(resumed, uninterrupted[SAVE_AT:])):
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.allclose(state[key], value, rtol=0, atol=1e-6), (SAVE_AT + step, key,
                                                                           (state[key] - value).abs().max().item())
    moved = max((uninterrupted[-1][k] - uninterrupted[SAVE_AT - 1][k]).abs().max().item() for k in uninterrupted[-1])
    assert moved > 1e-3  # the steps compared did train


@pytest.fixture(scope="module")
def pipe_tensor_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe2-tensor2")
    uninterrupted = _merged(run_distributed(pipe_tensor_save_body, 4, str(path), timeout=240))
    assert set(uninterrupted[0]) == set(build("llama-kv2").state_dict())
    return path, uninterrupted


@pytest.mark.parametrize("sequence,stage", [(1, 3), (2, 2)], ids=["data4-zero3", "sequence2-data2-zero2"])
def test_pipe_tensor_checkpoint_resumes_without_pipeline_or_tensor(pipe_tensor_checkpoint, tmp_path, sequence, stage):
    path, uninterrupted = pipe_tensor_checkpoint
    results = run_distributed(plain_resume_body, 4, str(path), str(tmp_path), sequence, stage, timeout=240)
    for states in results:  # every rank holds the whole logical model
        _assert_resumed(states, uninterrupted)
    _assert_same_state(path, tmp_path)


# ---------------------------------------------------------------- expert 2 x data 2 -> expert 1 x data 1

MOE_BATCH = 4  # micro-batches per step: one per rank at world 4, accumulated on one rank


def _moe_gpt(ep_size: int, scramble: bool = False) -> torch.nn.Module:
    from zerodist.models import GPTConfig
    from zerodist.models.moe_gpt import MoEConfig, MoEGPT

    torch.manual_seed(0)
    model = MoEGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2, d_ff=32),
                   MoEConfig(num_experts=4, ep_size=ep_size, k=1, capacity_factor=1.0, min_capacity=2))
    if scramble:
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.5, 0.5)
    return model


def _moe_steps(engine, first: int, last: int) -> list[dict[str, torch.Tensor]]:
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    states = []
    for step in range(first, last):
        for g in range(MOE_BATCH // shards):
            engine.backward(engine(*micro_batch(step, g * shards + shard, 0)))
            engine.step()
        states.append(engine.module_state_dict())
    return states


def moe_body(path: str, ep_size: int, stage: int, load: bool, again: str | None):
    world = torch.distributed.get_world_size()
    config = {"train_batch_size": MOE_BATCH * MICRO, "train_micro_batch_size_per_gpu": MICRO,
              "steps_per_print": 10**9, "optimizer": ADAMW, "zero_optimization": {"stage": stage}}
    engine = zerodist.initialize(model=_moe_gpt(ep_size, scramble=load), config=config)[0]
    assert engine.topology.degrees["expert"] == ep_size and engine.topology.degrees["data"] == world // ep_size
    if load:
        engine.load_checkpoint(path)
        assert engine.global_steps == SAVE_AT
        engine.save_checkpoint(again)
        states = _moe_steps(engine, SAVE_AT, SAVE_AT + AFTER)
    else:
        states = _moe_steps(engine, 0, SAVE_AT)
        engine.save_checkpoint(path)
        states += _moe_steps(engine, SAVE_AT, SAVE_AT + AFTER)
    engine.destroy()
    return states


def test_expert2_data2_checkpoint_resumes_on_one_process(tmp_path):
    saved, again = tmp_path / "saved", tmp_path / "again"
    uninterrupted = run_distributed(moe_body, 4, str(saved), 2, 2, False, None, timeout=240)[0]
    resumed = run_distributed(moe_body, 1, str(saved), 1, 1, True, str(again), timeout=240)[0]
    _assert_resumed(resumed, uninterrupted)
    _assert_same_state(saved, again)
