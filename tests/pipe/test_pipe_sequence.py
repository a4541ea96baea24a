"""Sequence x pipe: a model cut by `split_model` whose stages each run their attention
sequence-parallel over the sequence group ([Note: sequence x pipe] in zerodist/sequence/apply.py).
Every rank of a stage holds its slice of each sequence: the messages between stages are slices
(their bytes: the local sequence length), the stage glue numbers a slice's tokens by their places
in the whole sequence, and the loss is the token-weighted mean over the sequence group.

pipe 2 x sequence 2 on 4 gloo ranks (a tiny Hugging Face Llama, 2 query heads over 1 key/value
head, and the demo GPT), Ulysses and the ring, ZeRO 1 and 3, 5 steps of SGD with momentum:
parameters within 1e-6 of the unsplit model in one process on the whole sequences of the same
micro-batches, `eval_batch`'s loss within 1e-6 of the unsplit model's, and the bytes of each axis
equal their formulas (Ulysses' all-to-alls of the stage's one attention layer; the pipeline's sends
of [micro, seq/2, hidden] activations and gradients). Also the triple pipe 2 x tensor 2 x
sequence 2 on 8 ranks (Llama, 4 query over 2 key/value heads). All slow (4-8 ranks each)."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, LR, MICRO, SEQ, STEPS, build, config, eval_batch, logits_of, micro_batch
from zerodist.pipe import split_model, token_cross_entropy
from zerodist.sequence.layout import ulysses_bytes

pytestmark = pytest.mark.slow

SPLIT = {"llama": ["model.layers.1"], "llama-kv2": ["model.layers.1"], "gpt-untied": ["blocks.1"]}
# (query heads, key/value heads, head_dim, hidden) of test_split.build's models
SHAPES = {"llama": (2, 1, 8, 16), "llama-kv2": (4, 2, 4, 16), "gpt-untied": (2, 2, 8, 16)}


def _build(family: str, reference: bool = False) -> torch.nn.Module:
    model = build(family)
    if reference and family.startswith("llama"):  # the kernel the sequence-parallel attention runs locally
        model.set_attn_implementation("sdpa")
    return model


def reference_body(family: str):
    """One process, the unsplit model on whole sequences: gradient accumulation, SGD with momentum."""
    model = _build(family, reference=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, states = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            x, y = micro_batch(step, micro, 0)
            loss = token_cross_entropy(logits_of(model, x), y)
            (loss / GAS).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    model.eval()
    with torch.no_grad():
        evaluated = sum(token_cross_entropy(logits_of(model, eval_batch(m, 0)[0]), eval_batch(m, 0)[1]).item()
                        for m in range(GAS)) / GAS
    return losses, states, evaluated


def pipe_sequence_body(family: str, stage: int, method: str, tensor: int = 1):
    module = split_model(_build(family), split_points=SPLIT[family])
    settings = config(stage)
    settings["sequence_parallel_size"] = 2
    settings["zerodist"]["sequence_parallel"] = {"method": method}
    if tensor > 1:
        settings["tensor_parallel"] = {"autotp_size": tensor}
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    degrees = dict(engine.topology.degrees)
    assert degrees == {"pipe": 2, "data": 1, "expert": 1, "sequence": 2, "tensor": tensor}, degrees
    reports = engine.part_states.report()
    losses, states, traces = [], [], []
    for step in range(STEPS):
        with comm.trace() as trace:  # every sequence rank is given the whole sequences; it keeps its slice
            losses.append(engine.train_batch(iter([micro_batch(step, m, 0) for m in range(GAS)])).item())
        traces.append((trace.bus_bytes("all_to_all"), trace.total_bytes("send")))
        states.append(engine.module_state_dict())
    evaluated = engine.eval_batch(iter([eval_batch(m, 0) for m in range(GAS)])).item()  # sliced and weighted too
    engine.destroy()
    return losses, states, reports, traces, evaluated


def _expected_bytes(family: str, method: str, tensor: int) -> tuple[int, int] | None:
    """(all-to-all bus bytes, p2p bytes sent) of one batch on a rank: one attention layer per stage,
    forward and backward per micro-batch; the stage's activations (or their gradients) of the local
    sequence length, one message per micro-batch. None for the ring (its sends are p2p too)."""
    heads, kv_heads, head_dim, hidden = SHAPES[family]
    if method != "ulysses":
        return None
    one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=heads // tensor, kv_heads=kv_heads // tensor,
                        head_dim=head_dim, degree=2, element_size=4)
    return 2 * GAS * one, GAS * 4 * MICRO * (SEQ // 2) * hidden


def check(family: str, stage: int, method: str, tensor: int = 1) -> None:
    (ref_losses, ref_states, ref_evaluated), = run_distributed(reference_body, 1, family)
    results = run_distributed(pipe_sequence_body, 4 * tensor, family, stage, method, tensor, timeout=300)
    expected = _expected_bytes(family, method, tensor)
    keys: set[str] = set()
    for losses, states, reports, traces, evaluated in results:
        assert any(line.startswith(f"sequence parallel: {method} over 2 ranks") for line in reports), reports
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert evaluated == pytest.approx(ref_evaluated, rel=1e-6)
        for step, state in enumerate(states):
            keys |= set(state)  # this stage's parameters, under the model's names
            for key, value in state.items():
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=1e-6), (family, step, key)
        if expected is not None:
            assert all(trace == expected for trace in traces), (traces, expected)
    assert keys == set(ref_states[0])


@pytest.mark.parametrize("family, stage, method", [
    ("llama", 1, "ulysses"), ("llama", 3, "ulysses"), ("llama", 1, "ring"), ("gpt-untied", 3, "ulysses"),
])
def test_split_model_pipe2_sequence2_equals_one_process(family, stage, method):
    check(family, stage, method)


@pytest.mark.parametrize("stage", [1, 3])
def test_split_llama_pipe2_tensor2_sequence2_on_8_ranks(stage):
    check("llama-kv2", stage, "ulysses", tensor=2)


def layer_spec_refused_body():
    from zerodist.pipe import PipelineModule

    layers = [torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)]
    module = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.CrossEntropyLoss())
    settings = config(1)
    settings["sequence_parallel_size"] = 2
    try:
        zerodist.initialize(model=module, config=settings)
    except Exception as error:  # noqa: BLE001 - the test reads its type and message
        return type(error).__name__, str(error)
    return None


def test_a_pipeline_module_of_layers_is_refused_by_name_on_every_rank():
    for result in run_distributed(layer_spec_refused_body, 4, timeout=120):
        assert result is not None and result[0] == "SequenceParallelError" and "split_model" in result[1], result
