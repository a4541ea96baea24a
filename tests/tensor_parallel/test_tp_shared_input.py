"""One copy to the tensor region per prepared module: Megatron's all-reduce count on models with
separate q/k/v and gate/up projections (a layer_specs model, Hugging Face Llama), GPT-2 kept at it,
sequence parallelism's all-gathers shared the same way; parity with one process."""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import zerodist.comm as comm
from zerodist.tensor_parallel import (
    PrepareInput,
    hf_gpt2_plan,
    hf_llama_plan,
    parallelize,
    plan_from_deepspeed,
    shared_inputs,
)
from tests.harness import distributed_test
from tests.tensor_parallel import llama_like
from tests.tensor_parallel.test_tp_parallelize import _batches, _train_and_compare

pytestmark = pytest.mark.multiprocess

BATCH, SEQ = 4, 8
HIDDEN = 32  # every model below


def tiny(kind, dtype=torch.float64):
    """(model, plan, loss(model, idx, targets), vocabulary) for kind in llama_like / llama / gpt2."""
    torch.manual_seed(0)
    if kind == "llama_like":
        model = llama_like.LlamaLike().to(dtype)
        plan = plan_from_deepspeed(model, {"layer_specs": llama_like.LAYER_SPECS})
        return model, plan, lambda m, idx, targets: m(idx, targets), llama_like.VOCAB
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          attn_implementation="eager")
        model = transformers.LlamaForCausalLM(config).to(dtype)
        plan = hf_llama_plan(model)
    else:
        config = transformers.GPT2Config(vocab_size=66, n_positions=SEQ, n_embd=HIDDEN, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        config._attn_implementation = "eager"
        model = transformers.GPT2LMHeadModel(config).to(dtype)
        plan = hf_gpt2_plan(model)
    return model, plan, lambda m, idx, targets: m(input_ids=idx, labels=targets).loss, config.vocab_size


# Activation-sized all-reduces per step beyond the blocks' 4 each: the vocab-parallel embedding
# (forward) and the gathered LM head's input gradient (backward); the layer_specs model keeps its
# embedding replicated (DeepSpeed's layer_specs split linears only).
EXTRAS = {"llama_like": 1, "llama": 2, "gpt2": 2}


def activation_all_reduces(recorded, tokens):
    return sum(1 for r in recorded.records if r.op == "all_reduce" and r.numel == tokens * HIDDEN)


@distributed_test(world_size=2)
@pytest.mark.parametrize("kind", ["llama_like", "llama", "gpt2"])
def test_all_reduces_per_step_are_megatrons(kind):
    model, plan, loss_of, vocab = tiny(kind, torch.float32)
    topology = comm.Topology(tensor=2)
    parallel = parallelize(copy.deepcopy(model), plan, topology)
    idx, targets = _batches(1, BATCH, SEQ, vocab)[0]
    with comm.trace() as forward:
        loss = loss_of(parallel, idx, targets)
    with comm.trace() as backward:
        loss.backward()
    tokens = BATCH * SEQ
    # Megatron's f and g: per block 2 forward (after the attention's and the MLP's row layer) and 2
    # backward (the attention's and the MLP's input, however many column layers read it).
    assert activation_all_reduces(forward, tokens) == 2 * 2 + (EXTRAS[kind] - 1)
    assert activation_all_reduces(backward, tokens) == 2 * 2 + 1
    assert backward.count() == backward.count("all_reduce")  # nothing else in backward
    if kind != "gpt2":  # GPT-2 fuses q/k/v: one column layer per module, nothing to share
        assert any(isinstance(entry, PrepareInput) for entry in plan.values())


@distributed_test(world_size=[2, 4])
def test_layer_specs_shared_copy_matches_one_process_for_three_adamw_steps(world_size):
    _parity("llama_like", world_size)


@distributed_test(world_size=2)  # 2 key/value heads (grouped-query attention): tensor 2 at most
def test_hugging_face_llama_shared_copy_matches_one_process_for_three_adamw_steps(world_size):
    _parity("llama", world_size)


def _parity(kind, world_size):
    model, plan, loss_of, vocab = tiny(kind)
    topology = comm.Topology(tensor=world_size)
    parallel = parallelize(copy.deepcopy(model), plan, topology)
    _train_and_compare(model, parallel, topology, _batches(3, 2, SEQ, vocab), torch.float64, loss_of)


@distributed_test(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sequence_parallel_shares_one_all_gather_per_module(dtype):
    model, plan, loss_of, vocab = tiny("llama_like", dtype)
    topology = comm.Topology(tensor=2)
    sequence_plan = llama_like.sequence_parallel_plan(plan)
    parallel = parallelize(copy.deepcopy(model), sequence_plan, topology, sequence_parallel=True)
    idx, targets = _batches(1, BATCH, SEQ, vocab)[0]
    with comm.trace() as forward:
        loss = loss_of(parallel, idx, targets)
    with comm.trace() as backward:
        loss.backward()
    tokens, layers = BATCH * SEQ, llama_like.LAYERS
    sizes = lambda trace, op: Counter(r.numel for r in trace.records if r.op == op)  # noqa: E731
    # One all-gather per prepared module (attention, MLP) and for the LM head, one reduce-scatter per
    # row layer: the same pairs as Megatron's fused layers; backward their adjoints, plus the all-gather
    # of the embedding's sequence split. The head's gathered logits (T x V) besides.
    pairs = 2 * layers + 1
    assert sizes(forward, "all_gather") == Counter({tokens * HIDDEN: pairs, tokens * vocab: 1})
    assert sizes(forward, "reduce_scatter") == Counter({tokens * HIDDEN: 2 * layers})
    assert sizes(backward, "reduce_scatter") == Counter({tokens * HIDDEN: pairs})
    assert sizes(backward, "all_gather") == Counter({tokens * HIDDEN: 2 * layers + 1})
    assert forward.count("all_reduce") == 0 and backward.count("all_reduce") == 0
    parallel.zero_grad()
    _train_and_compare(model, parallel, topology, _batches(3, 2, SEQ, vocab), dtype, loss_of)


class _Mixed(nn.Module):
    """Column layers reading the prepared input, another tensor, and the input read otherwise too."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 1)  # replicated, reads x as well

    def forward(self, x):
        doubled = x * 2
        hidden = self.a(x) * self.b(x) + self.c(doubled)
        return self.out(hidden) * torch.sigmoid(self.gate(x)) + x


@distributed_test(world_size=2)
def test_sharing_is_by_tensor_identity_so_any_module_code_stays_exact():
    torch.manual_seed(3)
    reference = nn.Sequential(_Mixed(), _Mixed()).to(torch.float64)
    plan = shared_inputs(reference, {"*.a": "colwise", "*.b": "colwise", "*.c": "colwise", "*.out": "rowwise"})
    assert plan["0"] == PrepareInput() and plan["1"] == PrepareInput()
    topology = comm.Topology(tensor=2)
    parallel = parallelize(copy.deepcopy(reference), plan, topology)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    loss = parallel(x).square().sum()
    with comm.trace() as backward:
        loss.backward()
    # Per module: one reduction for a and b (they read x), one for c (it reads x * 2).
    assert backward.count("all_reduce") == 4
    parallel.zero_grad()
    _train_and_compare(reference, parallel, topology, [(x.detach(), None)] * 3, torch.float64,
                       lambda model, inputs, _: model(inputs).square().sum())


class _OneUnused(nn.Module):
    """Two column layers read x; only one's output reaches the loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        self.b(x)  # computed, never used
        return self.out(torch.tanh(self.a(x)))


@distributed_test(world_size=2)
def test_a_group_layer_left_out_of_the_backward_is_still_exact():
    torch.manual_seed(5)
    reference = _OneUnused().to(torch.float64)
    wrapped = nn.Sequential(reference)
    plan = shared_inputs(wrapped, {"0.a": "colwise", "0.b": "colwise", "0.out": "rowwise"})
    assert plan["0"] == PrepareInput()
    topology = comm.Topology(tensor=2)
    parallel = parallelize(copy.deepcopy(wrapped), plan, topology)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    x_parallel = x.detach().clone().requires_grad_(True)
    wrapped(x).square().sum().backward()
    parallel(x_parallel).square().sum().backward()
    torch.testing.assert_close(x_parallel.grad, x.grad, rtol=1e-12, atol=1e-12)


@distributed_test(world_size=2)
@pytest.mark.parametrize("kind", ["llama_like", "llama"])
def test_shared_reduction_still_runs_under_a_weight_gradient_matmul(kind):
    from zerodist.tensor_parallel import schedule_log

    model, plan, loss_of, vocab = tiny(kind, torch.float32)
    parallel = parallelize(copy.deepcopy(model), plan, comm.Topology(tensor=2))
    idx, targets = _batches(1, BATCH, SEQ, vocab)[0]
    with schedule_log() as log:
        loss_of(parallel, idx, targets).backward()
    # Each group's last layer reduces the group's sum asynchronously and computes its own weight
    # gradient before waiting: every backward byte (blocks and head) overlapped, as Megatron's.
    assert log.overlap_fraction("backward", include_sync=True) == 1.0
    assert len(log.issued_sizes("backward")) == 2 * 2 + 1
