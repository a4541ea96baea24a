"""The built-in tensor-parallel plan for Hugging Face GPT-2 (Conv1D layers, fused c_attn, the LM
head tied to wte) against one process, alone and under ZeRO on a data x tensor mesh."""

import copy

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.checkpoint import consolidate_checkpoint
from zerodist.tensor_parallel import (
    ColumnParallelConv1D,
    PlanError,
    RowParallelConv1D,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    hf_gpt2_plan,
    parallelize,
)
from tests.harness import distributed_test, run_distributed
from tests.test_tp_parallelize import _batches, _train_and_compare

transformers = pytest.importorskip("transformers")

VOCAB = 66  # split evenly at tensor 2, padded to 68 at tensor 4 (the embedding and the tied head)
SEQ = 8


def _config(**overrides):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    config._attn_implementation = "eager"
    return config


def _gpt2(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_config(**overrides)).to(dtype)


def _hf_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss  # Hugging Face's own shifted cross entropy


@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpt2_plan_matches_one_process_for_three_adamw_steps(world_size, dtype):
    topology = comm.Topology(tensor=world_size)
    reference = _gpt2(dtype)
    user_attention = reference.transformer.h[0].attn
    parallel = parallelize(copy.deepcopy(reference), hf_gpt2_plan(reference), topology)

    attention = parallel.transformer.h[0].attn
    assert isinstance(attention, type(user_attention)) and attention is not user_attention
    assert isinstance(attention.c_attn, ColumnParallelConv1D) and isinstance(attention.c_proj, RowParallelConv1D)
    assert attention.c_attn.weight.shape == (32, 3 * 32 // world_size)  # Conv1D layout [in, out / t]
    assert attention.num_heads == 4 // world_size and attention.split_size == 32 // world_size
    assert user_attention.num_heads == 4 and user_attention.split_size == 32  # the user's module is untouched
    assert isinstance(parallel.transformer.h[0].mlp.c_proj, RowParallelConv1D)
    assert isinstance(parallel.transformer.wte, VocabParallelEmbedding)
    assert isinstance(parallel.lm_head, TiedVocabParallelHead)
    assert parallel.lm_head.weight is parallel.transformer.wte.weight  # still tied
    # Init is pure slicing (bitwise, checked inside) and the loss is HF's own on gathered logits.
    # AdamW eps 1e-4: GPT-2's biases start at zero, so after 3 steps their norm is lr-sized, and a
    # value bias's gradient that cancels to ~3e-6 is amplified by m / (sqrt(v) + 1e-6) into an
    # lr-sized step: at eps 1e-6 the one-process fp32 run itself is 4.7e-6 (relative) from fp64 in
    # c_attn.bias, tensor 4 1.6e-5; fp64 at 1e-12 is the exactness check.
    _train_and_compare(reference, parallel, topology, _batches(3, 2, SEQ, VOCAB), dtype, _hf_loss, eps=1e-4)
    assert parallel.lm_head.weight is parallel.transformer.wte.weight


@distributed_test(world_size=2)
def test_gpt2_plan_named_errors():
    topology = comm.Topology(tensor=2)
    with pytest.raises(PlanError, match="sequence-parallel"):
        hf_gpt2_plan(_gpt2(), sequence_parallel=True)
    with pytest.raises(PlanError, match="cross-attention"):
        hf_gpt2_plan(_gpt2(add_cross_attention=True))
    three_heads = _gpt2(n_head=3, n_embd=24)
    with pytest.raises(ValueError, match=r"attention heads \(n_head\).*3.*2"):
        parallelize(three_heads, hf_gpt2_plan(three_heads), topology)
