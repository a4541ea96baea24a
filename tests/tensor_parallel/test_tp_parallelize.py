"""parallelize(): the demo GPT, a Hugging Face Llama and DeepSpeed's layer_specs against one process."""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import zerodist.comm as comm
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.tensor_parallel import (
    ColumnParallelLinear,
    HeadParallelAttention,
    PlanError,
    Replace,
    RowParallelLinear,
    VocabParallelEmbedding,
    gpt_plan,
    hf_llama_plan,
    parallelize,
    plan_from_deepspeed,
    reduce_partial_gradients,
    tensor_parallel_rng,
    unsliced_gradients,
    unsliced_state_dict,
)
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
GPT_SHAPE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def _close(actual, expected, dtype, what):
    """fp64: elementwise within 1e-12. fp32: within 1e-5 relative to the tensor's norm (AdamW's
    m / sqrt(v) turns a rounding-level difference in a near-zero gradient into an lr-sized one
    for that element, so elementwise relative error is not the measure of agreement there)."""
    if dtype == torch.float64:
        torch.testing.assert_close(actual, expected, **TOLERANCE[dtype], msg=lambda m: f"{what}: {m}")
        return
    error = (actual - expected).norm().item()
    assert error <= 1e-5 * expected.norm().item() + 1e-7, f"{what}: |difference| {error:.3g} vs |expected| " \
        f"{expected.norm().item():.3g}"


def _batches(steps, batch, seq, vocab):
    generator = torch.Generator().manual_seed(123)
    return [(torch.randint(0, vocab, (batch, seq), generator=generator),
             torch.randint(0, vocab, (batch, seq), generator=generator)) for _ in range(steps)]


def _train_and_compare(reference, parallel, topology, batches, dtype, loss_of, eps=1e-6):
    """3 AdamW steps on both; loss, every gathered gradient and every parameter compared."""
    assert unsliced_state_dict(parallel).keys() == reference.state_dict().keys()
    for key, value in unsliced_state_dict(parallel).items():  # slicing is exact
        assert torch.equal(value, reference.state_dict()[key]), key
    # eps 1e-6: the attention key bias has an exactly-zero gradient (softmax ignores a per-row
    # constant), so in fp32 it holds rounding noise (~1e-9) that eps 1e-8 would turn into
    # lr-sized steps of random sign, different in any two correct implementations.
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=eps)
    opt_tp = torch.optim.AdamW(parallel.parameters(), lr=1e-2, eps=eps)
    for idx, targets in batches:
        loss_ref, loss_tp = loss_of(reference, idx, targets), loss_of(parallel, idx, targets)
        loss_ref.backward()
        loss_tp.backward()
        reduce_partial_gradients(parallel, topology)
        _close(loss_tp, loss_ref, dtype, "loss")
        grads_ref = {n: p.grad for n, p in reference.named_parameters()}
        grads_tp = unsliced_gradients(parallel)
        assert grads_tp.keys() == grads_ref.keys()
        for name, grad in grads_tp.items():
            _close(grad, grads_ref[name], dtype, f"gradient of {name}")
        for opt in (opt_ref, opt_tp):
            opt.step()
            opt.zero_grad()
    for name, value in unsliced_state_dict(parallel).items():
        _close(value, reference.state_dict()[name], dtype, name)


@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_plan_matches_one_process_for_three_adamw_steps(world_size, dtype, sequence_parallel):
    topology = comm.Topology(tensor=world_size)
    torch.manual_seed(0)
    reference = GPT(GPT_SHAPE).to(dtype)
    parallel = parallelize(copy.deepcopy(reference), gpt_plan(sequence_parallel=sequence_parallel), topology,
                           sequence_parallel=sequence_parallel)
    block = parallel.blocks[0]
    assert isinstance(block.attn, HeadParallelAttention) and isinstance(block.mlp.fc_out, RowParallelLinear)
    assert isinstance(parallel.tok_emb, VocabParallelEmbedding) and isinstance(parallel.lm_head, ColumnParallelLinear)
    assert block.attn.qkv.weight.shape == (3 * 32 // world_size, 32)
    _train_and_compare(reference, parallel, topology, _batches(3, 4, 16, 64), dtype,
                       lambda model, idx, targets: model(idx, targets))


@distributed_test(world_size=2)
def test_gpt_plan_refuses_tied_embeddings_and_bad_plans():
    topology = comm.Topology(tensor=2)
    tied = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2, tie_embeddings=True))
    with pytest.raises(PlanError, match="one tied parameter"):
        parallelize(tied, gpt_plan(), topology)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(PlanError, match="matches no module"):
        parallelize(model, {"blocks.*.mlp.fc_middle": "colwise"}, topology)
    with pytest.raises(PlanError, match="unknown word 'colwsie'.*did you mean 'colwise'"):
        parallelize(model, {"lm_head": "colwsie"}, topology)
    with pytest.raises(PlanError, match="applies to Linear, but 'ln_f' is a LayerNorm"):
        parallelize(model, {"ln_f": "rowwise"}, topology)
    with pytest.raises(PlanError, match="matched by both"):
        parallelize(model, {"lm_head": "colwise", "lm_*": "colwise_rep"}, topology)


def _tiny_llama(heads, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=32,
                                      attn_implementation="eager", **overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


@distributed_test(world_size=[2, 4])
def test_hugging_face_llama_unchanged_code_matches_one_process(world_size):
    topology = comm.Topology(tensor=world_size)
    reference = _tiny_llama(heads=4)
    parallel = parallelize(copy.deepcopy(reference), hf_llama_plan(reference), topology)
    attention = parallel.model.layers[0].self_attn
    assert isinstance(attention.q_proj, ColumnParallelLinear) and isinstance(attention.o_proj, RowParallelLinear)
    assert attention.q_proj.weight.shape == (32 // world_size, 32)
    _train_and_compare(reference, parallel, topology, _batches(3, 2, 16, 64), torch.float64,
                       lambda model, idx, targets: model(input_ids=idx, labels=targets).loss)


@distributed_test(world_size=2)
def test_hugging_face_llama_with_tied_embeddings_stays_tied():
    topology = comm.Topology(tensor=2)
    reference = _tiny_llama(heads=4, tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    parallel = parallelize(copy.deepcopy(reference), hf_llama_plan(reference), topology)
    assert parallel.lm_head.weight is parallel.model.embed_tokens.weight
    _train_and_compare(reference, parallel, topology, _batches(3, 2, 16, 64), torch.float64,
                       lambda model, idx, targets: model(input_ids=idx, labels=targets).loss)


@distributed_test(world_size=2)
@pytest.mark.parametrize("tied", [False, True])
def test_hugging_face_llama_megatron_sequence_parallel_matches_one_process(tied):
    """[Note: Megatron SP on Hugging Face models]: the residual stream split along the sequence
    between the tensor layers of an unchanged Hugging Face Llama."""
    topology = comm.Topology(tensor=2)
    reference = _tiny_llama(heads=4, tie_word_embeddings=tied)
    parallel = parallelize(copy.deepcopy(reference), hf_llama_plan(reference, sequence_parallel=True), topology,
                           sequence_parallel=True)
    assert parallel.model.layers[0].self_attn.q_proj.sequence_parallel
    idx, targets = _batches(1, 2, 16, 64)[0]
    with comm.trace() as forward:
        loss = parallel(input_ids=idx, labels=targets).loss
    loss.backward()
    parallel.zero_grad()
    tokens, hidden, layers = 2 * 16, 32, 2
    sizes = Counter((r.op, r.numel) for r in forward.records)
    # per block 2 all-gathers and 2 reduce-scatters of the whole T x hidden (the attention's at its entry,
    # the MLP's in gate_proj); the embedding's output all-reduced whole; the head gathers the final norm's
    # slices, then the vocabulary
    assert sizes == Counter({("all_gather", tokens * hidden): 2 * layers + 1, ("reduce_scatter", tokens * hidden): 2 * layers,
                             ("all_reduce", tokens * hidden): 1, ("all_gather", tokens * 64): 1}), sizes
    _train_and_compare(reference, parallel, topology, _batches(3, 2, 16, 64), torch.float64,
                       lambda model, idx, targets: model(input_ids=idx, labels=targets).loss)


class _FusedMLP(nn.Module):
    """A user's module with a fused gate/up weight, named as Phi/Llama variants name it."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(8, 2 * 16)
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


@distributed_test(world_size=2)
def test_deepspeed_layer_specs_with_fused_sub_parameters():
    topology = comm.Topology(tensor=2)
    torch.manual_seed(1)
    reference = nn.Sequential(_FusedMLP(), _FusedMLP()).to(torch.float64)
    config = {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
         "partition_dim": 0},
    ]}
    plan = plan_from_deepspeed(reference, config)
    assert sorted(plan) == ["0.down_proj", "0.gate_up_proj", "1.down_proj", "1.gate_up_proj"]
    parallel = parallelize(copy.deepcopy(reference), plan, topology)
    assert parallel[0].gate_up_proj.weight.shape == (16, 8)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _train_and_compare(reference, parallel, topology, [(x, None)] * 3, torch.float64,
                       lambda model, inputs, _: model(inputs).square().sum())
    with pytest.raises(PlanError, match="partition_type is 'diagonal'"):
        plan_from_deepspeed(reference, {"layer_specs": [{"patterns": [".*"], "partition_type": "diagonal"}]})
    with pytest.raises(PlanError, match="match no parameter"):
        plan_from_deepspeed(reference, {"layer_specs": [{"patterns": ["nothing"], "partition_type": "row"}]})


@distributed_test(world_size=2)
def test_rng_tracker_replicated_and_sharded_streams():
    topology = comm.Topology(tensor=2)
    tracker = tensor_parallel_rng(topology, seed=5)
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    with tracker.fork("replicated"):
        replicated = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with tracker.fork("sharded"):
        sharded = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(torch.random.get_rng_state(), before)  # the default stream is untouched
    masks = [None, None]
    comm.all_gather_object(masks, (replicated, sharded), group=topology.group("tensor"))
    assert torch.equal(masks[0][0], masks[1][0]) and not torch.equal(masks[0][1], masks[1][1])
    saved = tracker.state_dict()
    with tracker.fork("sharded"):
        first = torch.rand(4)
    tracker.load_state_dict(saved)
    with tracker.fork("sharded"):
        assert torch.equal(torch.rand(4), first)  # streams resume from a saved state


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


@distributed_test(world_size=2)
def test_frozen_weights_stay_frozen_through_conversion():
    """A converted layer's slices are new parameters: those cut from a frozen weight stay frozen (by
    name), a replacement with other names is frozen whole when its module was, and one whose module
    was frozen in part is refused (no knowing which new parameter is which)."""
    topology = comm.Topology(tensor=2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)
    parallelize(model, {"0": "colwise", "1": "rowwise"}, topology)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["0.weight"]

    def renamed(module, region, sequence_parallel):  # noqa: ANN001, ANN202 - the plan's builder signature
        return nn.ModuleDict({"first": module.a, "second": module.b})

    frozen_whole = nn.ModuleDict({"pair": _Pair().requires_grad_(False)})
    parallelize(frozen_whole, {"pair": Replace(renamed)}, topology)
    assert not any(p.requires_grad for p in frozen_whole.parameters())
    half = nn.ModuleDict({"pair": _Pair()})
    half.pair.a.requires_grad_(False)
    with pytest.raises(PlanError, match="no parameter named a.bias, a.weight, which is frozen"):
        parallelize(half, {"pair": Replace(renamed)}, topology)
