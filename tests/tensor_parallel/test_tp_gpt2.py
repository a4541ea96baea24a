"""The built-in tensor-parallel plan for Hugging Face GPT-2 (Conv1D layers, fused c_attn, the LM
head tied to wte) against one process, alone and under ZeRO on a data x tensor mesh."""

import copy
from collections import Counter

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.checkpoint import consolidate_checkpoint
from zerodist.debug import check_weight_sync
from zerodist.tensor_parallel import (
    ColumnParallelConv1D,
    ColumnParallelLinear,
    PlanError,
    RowParallelConv1D,
    TiedHead,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    hf_gpt2_plan,
    parallelize,
    unsliced_state_dict,
)
from tests.harness import distributed_test, run_distributed
from tests.tensor_parallel.test_tp_parallelize import _batches, _train_and_compare

pytestmark = pytest.mark.multiprocess

transformers = pytest.importorskip("transformers")

VOCAB = 66  # split evenly at tensor 2, padded to 68 at tensor 4 (the embedding and the tied head)
SEQ = 8


def _config(**overrides):
    shape = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config = transformers.GPT2Config(**{**shape, **overrides})
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
def test_gpt2_megatron_sequence_parallel_matches_one_process():
    """[Note: Megatron SP on Hugging Face models] in zerodist/tensor_parallel/plans.py: the residual
    stream between GPT-2's tensor layers split along the sequence (fp64: exactness)."""
    topology = comm.Topology(tensor=2)
    reference = _gpt2(torch.float64)
    parallel = parallelize(copy.deepcopy(reference), hf_gpt2_plan(reference, sequence_parallel=True), topology,
                           sequence_parallel=True)
    assert parallel.transformer.h[0].attn.c_attn.sequence_parallel and parallel.lm_head.weight is \
        parallel.transformer.wte.weight
    idx = _batches(1, 2, SEQ, VOCAB)[0][0]
    with comm.trace() as forward:
        _hf_loss(parallel, idx, idx)
    tokens, hidden = 2 * SEQ, 32
    sizes = Counter((r.op, r.numel) for r in forward.records)
    # per block: c_attn and c_fc gather the whole T x hidden, both c_proj reduce-scatter it; wte's output
    # all-reduced whole; the tied head gathers ln_f's slices, then the vocabulary
    assert sizes == Counter({("all_gather", tokens * hidden): 2 * 2 + 1, ("reduce_scatter", tokens * hidden): 2 * 2,
                             ("all_reduce", tokens * hidden): 1, ("all_gather", tokens * VOCAB): 1}), sizes
    _train_and_compare(reference, parallel, topology, _batches(3, 2, SEQ, VOCAB), torch.float64, _hf_loss, eps=1e-4)


@distributed_test(world_size=2)
def test_gpt2_plan_named_errors():
    topology = comm.Topology(tensor=2)
    with pytest.raises(PlanError, match="cross-attention"):
        hf_gpt2_plan(_gpt2(add_cross_attention=True))
    model = _gpt2()
    with pytest.raises(PlanError, match="ties it to 'transformer.wte', which the plan must make 'vocab'"):
        parallelize(model, {"lm_head": TiedHead("transformer.wte")}, topology)
    with pytest.raises(PlanError, match="one tied parameter.*TiedHead"):
        parallelize(model, {"transformer.wte": "vocab", "lm_head": "colwise_rep"}, topology)
    untied = _gpt2(tie_word_embeddings=False)
    with pytest.raises(PlanError, match="lm_head.weight is not tied to transformer.wte.weight"):
        parallelize(untied, {"transformer.wte": "vocab", "lm_head": TiedHead("transformer.wte")}, topology)
    reference = copy.deepcopy(untied)
    parallelize(untied, hf_gpt2_plan(untied), topology)  # an untied head: its own gathered column layer
    assert type(untied.lm_head) is ColumnParallelLinear
    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in unsliced_state_dict(untied).items())
    three_heads = _gpt2(n_head=3, n_embd=24)
    with pytest.raises(ValueError, match=r"attention heads \(n_head\).*3.*2"):
        parallelize(three_heads, hf_gpt2_plan(three_heads), topology)


# ------------------------------------------------------------------ ZeRO x TP through initialize
LR, EPS, CLIP, ROWS = 1e-2, 1e-4, 0.5, 4  # ROWS: sequences per step over all data shards; EPS: see above


def _engine_config(stage, tensor=2):
    return {
        "train_batch_size": ROWS, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}},
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tensor},  # no plan given: picked by config.model_type == "gpt2"
    }


def _ids(step):
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(900 + step))


def _reference(steps):
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = _hf_loss(model, _ids(step), _ids(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def _train_zero_by_tensor(stage, steps, path):
    engine = zerodist.initialize(model=_gpt2(), config=_engine_config(stage))[0]
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2, "expert": 1, "sequence": 1, "tensor": 2}
    assert isinstance(engine.module.lm_head, TiedVocabParallelHead)
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    rows = slice(shard * ROWS // shards, (shard + 1) * ROWS // shards)
    losses = []
    for step in range(steps):
        ids = _ids(step)[rows]
        loss = _hf_loss(engine, ids, ids)
        engine.backward(loss)
        engine.step()
        everyone = [None] * shards  # the global batch's loss: the mean over the data shards
        comm.all_gather_object(everyone, loss.item(), group=engine.topology.group("data"))
        losses.append(sum(everyone) / shards)
    if stage < 3:  # LayerNorms and row biases bitwise equal across tensor ranks, slices across data ranks
        assert check_weight_sync(engine).ok
    engine.save_checkpoint(path)
    zerodist.checkpoint.save_pretrained(engine, f"{path}/hf", max_shard_size="20KB")  # slices written unsliced
    state = engine.module_state_dict()
    # ... and read back into the slices of a fresh engine at tensor 4 (the vocabulary padded to 68)
    # and the other stage (stage 3: each rank reads only the runs it owns)
    fresh = zerodist.initialize(model=_gpt2(), config=_engine_config(1 if stage == 3 else 3, tensor=4))[0]
    zerodist.checkpoint.load_pretrained(fresh, f"{path}/hf")
    for key, value in fresh.module_state_dict().items():
        assert torch.equal(value, state[key]), key
    return losses, state


def _relative(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", [1, 3])
def test_gpt2_zero_by_tensor_parallel_matches_one_process(tmp_path, stage):
    """data 2 x tensor 2 (4 ranks) against one process on the same global batches; the unsliced
    state (module_state_dict, and the checkpoint consolidated without any process group) has
    GPT-2's names and shapes and loads into a plain GPT2LMHeadModel."""
    steps = 3
    losses, state = run_distributed(_train_zero_by_tensor, 4, stage, steps, str(tmp_path), timeout=240)[0]
    reference, reference_losses = _reference(steps)
    expected = reference.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in expected.items()}
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    for key, value in expected.items():
        assert _relative(state[key], value) <= 1e-5, f"{key}: {_relative(state[key], value):.2e}"
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # tied all along

    consolidated = consolidate_checkpoint(tmp_path)
    assert {k: v.shape for k, v in consolidated.items()} == {k: v.shape for k, v in expected.items()}
    for key, value in state.items():
        assert torch.equal(consolidated[key], value), key
    plain = transformers.GPT2LMHeadModel(_config())
    plain.load_state_dict(consolidated, strict=True)
    pretrained = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    for key, value in pretrained.state_dict().items():  # save_pretrained: the same unsliced weights
        assert torch.equal(value, state[key]), key
    ids = _ids(99)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def _init_built_against_eager(tied):
    config = _config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).state_dict()
    engines = []
    for lazy in (False, True):
        torch.manual_seed(0)
        with zerodist.zero.Init(enabled=lazy):
            model = transformers.GPT2LMHeadModel(config)
        engines.append(zerodist.initialize(model=model, config=_engine_config(3))[0])
    eager, built = engines
    state = built.module_state_dict()
    for key, value in plain.items():  # the slices replayed on the meta-built model are the eager ones
        assert torch.equal(state[key], value), key
    assert (built.module.lm_head.weight is built.module.transformer.wte.weight) == tied
    ids = _ids(0)[: ROWS // 2]
    for engine in (eager, built):
        engine.backward(_hf_loss(engine, ids, ids))
        engine.step()
    assert torch.equal(_hf_loss(eager, ids, ids), _hf_loss(built, ids, ids))


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_built_under_zero_init_gets_the_eager_slices(tied):
    """zero.Init + tensor 2 + ZeRO-3 on 4 ranks: the Conv1D slices, the head-parallel attention and
    the tied head replayed from the meta build equal the eager build's, bitwise."""
    run_distributed(_init_built_against_eager, 4, tied, timeout=240)
