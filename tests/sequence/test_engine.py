"""Sequence-parallel training through `zerodist.initialize()` against one process on the full
sequences: the demo GPT and a tiny Hugging Face Llama, at sequence 2 (2 ranks) and data 2 x
sequence 2 (4 ranks), ZeRO stages 0-3, 10 SGD steps, labels -100 present. Parameters equal the
one-process run within 1e-6, and are bitwise equal across the ranks that replicate them
(`check_weight_sync`: data x sequence), so gradients were neither multiplied nor divided by P.
"""

import pytest
import torch

import zerodist
from zerodist.debug import check_weight_sync
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.sequence import SequenceLayout
from zerodist.sequence.data import shard_batch
from tests.harness import distributed_test
from tests.hf_models import hf_class, hf_config

# LR 0.1: at 0.5 ten steps of this Llama amplify float32 rounding alone (eager against sdpa on one process:
# 1.4e-6 apart) past the tolerance; at 0.1 the two kernels end 1.5e-8 apart
SEQ, VOCAB, MICRO, STEPS, LR = 16, 32, 2, 10, 0.1
GPT_SHAPE = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=4, d_ff=32)


def _config(stage, data, method="ulysses"):
    return {"train_batch_size": MICRO * data, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "steps_per_print": 10**9, "sequence_parallel_size": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zerodist": {"sequence_parallel": {"method": method}}}


def _samples(step, rows):
    """Token ids and labels with -100 at every fifth position (some on each rank's slice)."""
    generator = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    ignored = (torch.arange(rows)[:, None] + torch.arange(SEQ)[None, :]) % 5 == 0
    return ids, labels.masked_fill(ignored, -100)


def _build(kind, reference=False):
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_SHAPE)
    model = hf_class("llama")(hf_config("llama", vocab_size=VOCAB))
    if reference:  # the kernel the sequence-parallel attention runs locally (torch's sdpa), not eager's
        model.set_attn_implementation("sdpa")
    return model


def _model_loss(kind, model, ids, labels):
    if kind == "gpt":  # the GPT's targets are the labels of its positions (shifted already)
        return model(ids, labels)
    return model(input_ids=ids, labels=labels).loss  # Hugging Face shifts labels itself


def _reference(kind, data):
    """One process, full sequences: each data shard's loss (a token mean), averaged over shards."""
    model = _build(kind, reference=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids, labels = _samples(step, MICRO * data)
        losses = [_model_loss(kind, model, ids[s * MICRO:(s + 1) * MICRO], labels[s * MICRO:(s + 1) * MICRO])
                  for s in range(data)]
        optimizer.zero_grad()
        (sum(losses) / data).backward()
        optimizer.step()
    return model.state_dict()


def _sliced_batch(kind, ids, labels, layout):
    if kind == "gpt":
        return shard_batch((ids, labels), layout)  # (ids, targets, position_ids), each this rank's slice
    return shard_batch({"input_ids": ids, "labels": labels}, layout)  # + position_ids, shift_labels


def _train(kind, stage, world_size, method="ulysses"):
    data = world_size // 2
    engine = zerodist.initialize(model=_build(kind), config=_config(stage, data, method))[0]
    topology = engine.topology
    layout = SequenceLayout(topology.axis_rank("sequence"), topology.size("sequence"), head_tail=method == "ring")
    shard = topology.batch_rank
    if kind == "gpt":
        ids0, labels0 = _samples(0, MICRO * data)
        ids0 = ids0[shard * MICRO:(shard + 1) * MICRO]
        assert shard_batch((ids0, labels0[:MICRO]), layout)[0].shape[1] == SEQ // 2
    for step in range(STEPS):
        ids, labels = _samples(step, MICRO * data)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        batch = _sliced_batch(kind, ids[rows], labels[rows], layout)
        output = engine(*batch) if kind == "gpt" else engine(**batch)
        loss = output if kind == "gpt" else output.loss
        engine.backward(loss)
        engine.step()
    if stage < 3:
        assert check_weight_sync(engine, raise_on_mismatch=True).ok
    state = engine.module_state_dict()
    engine.destroy()
    reference = _reference(kind, data)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=[2, 4], timeout=120)
def test_gpt_sequence_parallel_matches_one_process(stage, world_size):
    _train("gpt", stage, world_size)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=[2, 4], timeout=120)
def test_hf_llama_sequence_parallel_matches_one_process(stage, world_size):
    _train("llama", stage, world_size)


@pytest.mark.parametrize("kind,stage", [("gpt", 0), ("llama", 3)])
@distributed_test(world_size=2, timeout=120)
def test_ring_engine_matches_one_process(kind, stage, world_size):
    """The ring (head-tail chunks: rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11)."""
    _train(kind, stage, world_size, method="ring")
