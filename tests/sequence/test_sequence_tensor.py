"""Sequence x tensor parallelism through `zerodist.initialize()` (issue 31 item 4): data 1 x
sequence 2 x tensor 2 on 4 ranks, a tiny Hugging Face Llama (grouped key/value heads: 4 query and
2 key/value heads, so each tensor rank holds 2 and 1, and Ulysses replicates the one k/v head over
the 2 sequence ranks) and the demo GPT, Ulysses and the ring, ZeRO 1 and 3, 5 SGD steps.
Parameters equal one process on the same global batch within 1e-6, and each axis' bytes equal
their formulas: the sequence all-to-alls (or the ring's sends) over the local heads, the
tensor-parallel reductions over this rank's tokens, and ZeRO's reduction over data x sequence of
the tensor-local parameters. Also: Megatron's sequence parallelism inside each sequence slice, and
the 8-rank triple data 2 x sequence 2 x tensor 2 (slow).
"""

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.sequence import SequenceLayout
from zerodist.sequence.layout import ring_backward_bytes, ring_bytes, ulysses_bytes
from zerodist.tensor_parallel import schedule_log
from zerodist.train.report import expected_bus_bytes
from tests.harness import distributed_test
from tests.sequence.test_engine import GPT_SHAPE, MICRO, SEQ, VOCAB, _build, _model_loss, _samples, _sliced_batch

pytestmark = pytest.mark.multiprocess

STEPS, LR = 5, 0.1
# (query heads, key/value heads, head_dim, hidden, layers) of the two models (tests/hf_models.py, test_engine.py)
SHAPES = {"llama": (4, 2, 8, 32, 2), "gpt": (GPT_SHAPE.n_heads, GPT_SHAPE.n_heads, GPT_SHAPE.d_model // GPT_SHAPE.n_heads,
                                             GPT_SHAPE.d_model, GPT_SHAPE.n_layers)}


def _config(stage, data, tensor, method, megatron=False):
    return {"train_batch_size": MICRO * data, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "steps_per_print": 10**9, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": tensor},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zerodist": {"sequence_parallel": {"method": method},
                         "tensor_parallel": {"sequence_parallel": megatron}}}


def _reference(kind, data, steps):
    """One process, full sequences: each data shard's loss (a token mean), averaged over shards."""
    model = _build(kind, reference=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        ids, labels = _samples(step, MICRO * data)
        losses = [_model_loss(kind, model, ids[s * MICRO:(s + 1) * MICRO], labels[s * MICRO:(s + 1) * MICRO])
                  for s in range(data)]
        optimizer.zero_grad()
        (sum(losses) / data).backward()
        optimizer.step()
    return model.state_dict()


def _sequence_bytes(kind, method, tensor):
    """(forward, backward) bytes one rank sends over the sequence axis in one micro-batch."""
    heads, kv_heads, head_dim, _, layers = SHAPES[kind]
    if method == "ulysses":
        one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=heads // tensor, kv_heads=kv_heads // tensor,
                            head_dim=head_dim, degree=2, element_size=4)
        return layers * one, layers * one
    shape = dict(batch=MICRO, seq=SEQ, kv_heads=kv_heads // tensor, head_dim=head_dim, degree=2, element_size=4)
    return layers * ring_bytes(**shape), layers * ring_backward_bytes(**shape)


def _tensor_bytes(kind, megatron=False):
    """(forward, backward) bytes of the tensor-parallel collectives over this rank's T = B N/P
    tokens (A = T x hidden activations): per block one row-parallel all-reduce of A after the
    attention and one after the MLP, forward, and one input-gradient all-reduce per shared column
    input backward; per model the vocab-parallel embedding's all-reduce (forward) and the gathered
    logits' all-gather (T x vocab, forward) whose backward is the head's input-gradient all-reduce.
    With Megatron's sequence parallelism inside each sequence slice, every all-reduce becomes an
    all-gather and a reduce-scatter of A (the Llama's embedding keeps its all-reduce and its first
    layer's split gathers back in backward), and the demo GPT's backward gathers its positional
    embedding's split."""
    _, _, _, hidden, layers = SHAPES[kind]
    activation = 4 * MICRO * SEQ // 2 * hidden
    if megatron:
        backward = 2 * activation * (2 * layers + 1) + (activation if kind == "gpt" else 0)
        return 2 * activation * (2 * layers + 1) + _tensor_gather(kind), backward
    return activation * (2 * layers + 1) + _tensor_gather(kind), activation * (2 * layers + 1)


def _tensor_gather(kind):
    return 4 * MICRO * SEQ // 2 * VOCAB  # the gathered logits: T x vocab


def _train(kind, stage, method, world_size, megatron=False):
    tensor = 2
    data = world_size // (2 * tensor)
    torch.manual_seed(0)
    engine = zerodist.initialize(model=_build(kind), config=_config(stage, data, tensor, method, megatron))[0]
    topology = engine.topology
    assert dict(topology.degrees) == {"pipe": 1, "data": data, "expert": 1, "sequence": 2, "tensor": tensor}
    layout = SequenceLayout(topology.axis_rank("sequence"), 2, head_tail=method == "ring")
    shard = topology.batch_rank
    psi = sum(g.layout.total_numel for g in engine.groups)  # the tensor-local (padded) parameter count
    for step in range(STEPS):
        ids, labels = _samples(step, MICRO * data)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        batch = _sliced_batch(kind, ids[rows], labels[rows], layout)
        with schedule_log() as log:
            with comm.trace() as forward:
                output = engine(*batch) if kind == "gpt" else engine(**batch)
            with comm.trace() as backward:
                engine.backward(output if kind == "gpt" else output.loss)
        with comm.trace() as stepped:
            engine.step()
        _check_bytes(kind, method, stage, psi, data, (forward, backward, stepped), log, steady=step > 0, megatron=megatron)
    state = engine.module_state_dict()  # unsliced: the plain model's names and shapes
    engine.destroy()
    reference = _reference(kind, data, STEPS)
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def _check_bytes(kind, method, stage, psi, data, traces, log, steady, megatron):
    forward, backward, stepped = traces
    sequence = _sequence_bytes(kind, method, 2)
    sent = (lambda t: t.bus_bytes("all_to_all")) if method == "ulysses" else (lambda t: t.total_bytes("send"))
    assert (sent(forward), sent(backward)) == sequence, (forward.format_summary(), backward.format_summary())
    assert (log.all_bytes("forward"), log.all_bytes("backward")) == _tensor_bytes(kind, megatron)
    if not steady or megatron:
        # the first step's forward gathers at stage 3 what later steps prefetched in the step before; under
        # Megatron's sequence parallelism the norms' groups reduce over data x sequence x tensor and the
        # tensor axis' own traffic is all-gathers and reduce-scatters too (its bytes are checked above)
        return
    # ZeRO over data x sequence: the reduce-scatters and all-gathers over that group, but the tensor-parallel
    # all-gather of the logits (when its group is as large); docs/design/zero.md's formula with the
    # tensor-local parameter count. (Stage 3's step also all-gathers 20 int64 over the world: its agreement.)
    dense = 2 * data
    zero = sum(r.bus_bytes for t in traces for r in t.records
               if r.op in ("reduce_scatter", "all_gather") and r.group_size == dense)
    if dense == 2:  # the tensor group is as large: its gather of the logits was counted
        zero -= _tensor_gather(kind) / 2
    assert zero == expected_bus_bytes(stage=stage, psi=psi, world_size=dense, accumulation_steps=1,
                                      reduce_scatter=True, element_bytes=4)


SLOW = pytest.mark.slow  # about 15-25 s each on a 2-core machine (4 ranks, start-up included)


@pytest.mark.parametrize("kind,stage,method", [
    ("llama", 1, "ulysses"),
    pytest.param("llama", 3, "ulysses", marks=SLOW),
    pytest.param("gpt", 1, "ulysses", marks=SLOW),
    pytest.param("gpt", 3, "ring", marks=SLOW),
    pytest.param("llama", 1, "ring", marks=SLOW),
    pytest.param("llama", 3, "ring", marks=SLOW),
])
@distributed_test(world_size=4, timeout=180)
def test_sequence_by_tensor_matches_one_process(kind, stage, method, world_size):
    _train(kind, stage, method, world_size)


@pytest.mark.slow
@distributed_test(world_size=4, timeout=180)
def test_megatron_sequence_parallel_inside_ulysses(world_size):
    """zerodist.tensor_parallel.sequence_parallel as well: the activations between the tensor
    layers split once more, over the tensor ranks, within each rank's sequence slice."""
    _train("gpt", 1, "ulysses", world_size, megatron=True)


@distributed_test(world_size=4, timeout=120)
def test_ulysses_counts_the_heads_a_tensor_rank_holds(world_size):
    """4 heads over tensor 2 leave 2 per rank: fine for Ulysses over 2 (above); 2 heads leave 1,
    which 2 sequence ranks cannot split: a named error on every rank, the ring as the way out."""
    from zerodist.models.gpt import GPT, GPTConfig
    from zerodist.sequence import SequenceParallelError

    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    with pytest.raises(SequenceParallelError, match="with tensor parallelism of degree 2 each rank holds 1 of the 2 "
                                                    "query heads.*ring"):
        zerodist.initialize(model=model, config=_config(1, 1, 2, "ulysses"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
@distributed_test(world_size=8, timeout=400)
def test_data_by_tensor_by_sequence_on_8_ranks(stage, world_size):
    """Issue 31's triple: data 2 x sequence 2 x tensor 2, the Hugging Face Llama, Ulysses; ZeRO over
    data x sequence (4 ranks) of the tensor-local parameters."""
    _train("llama", stage, "ulysses", world_size)


@pytest.mark.slow
@distributed_test(world_size=4, timeout=180)
def test_megatron_sequence_parallel_inside_ulysses_on_hf_llama(world_size):
    _train("llama", 3, "ulysses", world_size, megatron=True)
