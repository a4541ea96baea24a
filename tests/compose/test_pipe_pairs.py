"""Issue 31's pairs and triple with the pipe axis, where the earlier tests left a gap (the acceptance
matrix: docs/design/composition.md): pipe x sequence at ZeRO 0 and 2, under interleaved virtual
stages, on Hugging Face GPT-2 and on the demo MoE GPT, and the ring's bytes under a pipeline (its
blocks and the stages' activations are both point-to-point sends: the tracer labels them by axis,
"sequence" and "pipe"); the bytes of the tensor axis on GPT-2 cut in two stages; and the triple
pipe 2 x data 2 x expert 2 at ZeRO 3 with the expert axis' bytes. Each: 5 SGD steps (momentum)
through `train_batch`, parameters within 1e-6 of the unsplit model in one process on the same
micro-batches (whole sequences), every rank's bytes per axis equal to their formulas. All slow
(4-8 gloo ranks each)."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.compose.parity import assert_states_match
from tests.harness import run_distributed
from tests.pipe import test_pipe_sequence as pipe_sequence
from tests.pipe.test_split import GAS, LR, MICRO, SEQ, STEPS, VOCAB, build, config, logits_of, micro_batch
from zerodist.pipe import split_model, token_cross_entropy
from zerodist.sequence.layout import ring_backward_bytes, ring_bytes, ulysses_bytes
from zerodist.tensor_parallel import schedule_log

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HIDDEN = 16
EXPERTS = 2


def moe_gpt(ep_size: int) -> torch.nn.Module:
    """The demo MoE GPT, 2 blocks (one MoE layer per stage), no token dropped: the capacity is every
    token of a call (`capacity_factor` = the number of experts), the balance loss weighted 0."""
    from zerodist.models import GPTConfig
    from zerodist.models.moe_gpt import MoEConfig, MoEGPT

    torch.manual_seed(0)
    return MoEGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=HIDDEN, n_layers=2, n_heads=2, dropout=0.0),
                  MoEConfig(num_experts=EXPERTS, ep_size=ep_size, drop_tokens=True, capacity_factor=float(EXPERTS),
                            min_capacity=0, aux_loss_coef=0.0))


def model_of(family: str, ep_size: int = 1, reference: bool = False) -> torch.nn.Module:
    model = moe_gpt(ep_size) if family == "moe-gpt" else build(family)
    if reference and family in ("llama", "gpt2"):  # the kernel the sequence-parallel attention runs locally
        model.set_attn_implementation("sdpa")
    return model


def reference_body(family: str, shards: int = 1, sdpa: bool = False):
    """One process, the unsplit model (every expert) on whole sequences: accumulation over the
    micro-batches of every batch shard, SGD with momentum; the state after each step. `sdpa`:
    Hugging Face attention by torch's kernel, the one a sequence-parallel rank runs locally."""
    model = model_of(family, reference=sdpa)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    states = []
    for step in range(STEPS):
        for micro in range(GAS):
            parts = [micro_batch(step, micro, d) for d in range(shards)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            (token_cross_entropy(logits_of(model, x), y) / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def compose_body(family: str, stage: int, *, sequence: int = 1, method: str = "ulysses", tensor: int = 1,
                 expert: int = 1, stages_per_rank: int = 1):
    """The model cut in 2 (x `stages_per_rank`) stages and trained; per step the rank's bytes:
    {"pipe": the stages' sent payloads, "ring": the ring's sends, "all_to_all": bus bytes,
     "tensor": (forward, backward) of the schedule log, "zero": bus bytes over a data group of 2}."""
    module = split_model(model_of(family, expert), num_stages=2, stages_per_rank=stages_per_rank,
                         split_points=["model.layers.1"] if family == "llama" and stages_per_rank == 1 else None)
    settings = config(stage, "interleaved" if stages_per_rank > 1 else "1f1b", stages_per_rank)
    if sequence > 1:
        settings["sequence_parallel_size"] = sequence
        settings["zerodist"]["sequence_parallel"] = {"method": method}
    if tensor > 1:
        settings["tensor_parallel"] = {"autotp_size": tensor}
    engine = zerodist.initialize(model=module, config=settings)[0]
    shard = engine.topology.batch_rank  # data x expert: each reads its own micro-batches
    flat_sizes = {g.layout.total_numel for g in engine.groups}
    states, tallies = [], []
    for step in range(STEPS):
        with schedule_log() as log, comm.trace() as trace:
            engine.train_batch(iter([micro_batch(step, m, shard) for m in range(GAS)]))
        sends = [r for r in trace.records if r.op == "send"]
        tallies.append({"pipe": sum(r.num_bytes for r in sends if r.label == "pipe"),
                        "ring": sum(r.num_bytes for r in sends if r.label == "sequence"),
                        "unlabelled": sum(r.num_bytes for r in sends if r.label not in ("pipe", "sequence")),
                        "all_to_all": trace.bus_bytes("all_to_all"),
                        "tensor": (log.all_bytes("forward"), log.all_bytes("backward")),
                        # ZeRO's reduce-scatters and all-gathers over a data group of 2 (no other axis has one)
                        "zero": sum(r.bus_bytes for r in trace.records
                                    if r.op in ("reduce_scatter", "all_gather") and r.group_size == 2),
                        # ZeRO's reduce-scatters and all-gathers of the flat groups, whatever their ranks
                        # (dense and expert; the MoE layers' small all-gathers are not ZeRO's)
                        "zero_all": sum(r.bus_bytes for r in trace.records if r.op in ("reduce_scatter", "all_gather")
                                        and r.numel in flat_sizes)})
        states.append(engine.module_state_dict())
    degrees = dict(engine.topology.degrees)
    pipe_rank = engine.topology.axis_rank("pipe")
    psi = sum(g.layout.total_numel for g in engine.groups)  # this stage's (padded) parameter count
    groups = [(g.layout.total_numel, g.world_size) for g in engine.groups]  # (Ψ, ranks it is sharded over)
    engine.destroy()
    return states, tallies, degrees, pipe_rank, psi, groups


def run(family: str, world: int, stage: int, shards: int = 1, timeout: int = 280, **options) -> list:
    """The composed run against one process: every parameter of every stage within 1e-6."""
    reference = run_distributed(reference_body, 1, family, shards, options.get("sequence", 1) > 1)[0]
    results = run_distributed(compose_body, world, family, stage, timeout=timeout, **options)
    assert_states_match((states for states, *_ in results), reference, family)
    return results


def activation_bytes(sequence: int = 1) -> int:
    """One micro-batch's hidden states between two stages: [micro, seq / sequence, hidden] floats."""
    return 4 * MICRO * (SEQ // sequence) * HIDDEN


# ---------------------------------------------------------------------------------------- pipe x sequence

@pytest.mark.parametrize("stage", [0, 2])
def test_pipe2_sequence2_llama_ulysses_at_zero_0_and_2(stage):
    """tests/pipe/test_pipe_sequence.py's check (parameters, eval_batch, Ulysses' and the pipe's
    bytes) at the two stages it leaves out."""
    pipe_sequence.check("llama", stage, "ulysses")


@pytest.mark.parametrize("stage", [1, 3])
def test_pipe2_sequence2_ring_bytes_are_told_from_the_stages_messages(stage):
    """The ring's K/V blocks (label "sequence") and the stages' activations (label "pipe") both
    travel as sends: each equals its own formula. Llama (2 query over 1 key/value head), one
    attention layer per stage, per micro-batch its forward and its backward rotations."""
    results = run("llama", 4, stage, sequence=2, method="ring")
    shape = dict(batch=MICRO, seq=SEQ, kv_heads=1, head_dim=8, degree=2, element_size=4)
    ring = GAS * (ring_bytes(**shape) + ring_backward_bytes(**shape))
    for _, tallies, degrees, *_ in results:
        assert degrees["sequence"] == 2 and degrees["pipe"] == 2
        for tally in tallies:
            assert (tally["ring"], tally["pipe"], tally["unlabelled"]) == (ring, GAS * activation_bytes(2), 0), tally


def test_pipe2_sequence2_interleaved_stages():
    """2 virtual stages per rank (the demo GPT of 4 blocks, its head tied to the embedding across
    rank 0's first and rank 1's last stage), Ulysses, ZeRO 3: each virtual stage's attention over
    the sequence group; the pipe sends 2 boundaries' worth per rank."""
    results = run("gpt-deep", 4, 3, sequence=2, stages_per_rank=2)
    one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=2, kv_heads=2, head_dim=8, degree=2, element_size=4)
    for _, tallies, *_ in results:
        for tally in tallies:
            assert tally["all_to_all"] == 2 * 2 * GAS * one, tally  # 2 blocks per rank, forward and backward
            # 3 boundaries' messages per rank and micro-batch: rank 0 sends 0->1 and 2->3 forward and
            # 2->1 backward, rank 1 sends 1->2 forward and 3->2 and 1->0 backward
            assert tally["pipe"] == 3 * GAS * activation_bytes(2), tally


def test_pipe2_sequence2_hf_gpt2():
    """Hugging Face GPT-2 (Conv1D; `wte` tied to the head across the stages), Ulysses, ZeRO 1."""
    results = run("gpt2", 4, 1, sequence=2)
    one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=2, kv_heads=2, head_dim=8, degree=2, element_size=4)
    for _, tallies, *_ in results:
        for tally in tallies:
            assert (tally["all_to_all"], tally["pipe"]) == (2 * GAS * one, GAS * activation_bytes(2)), tally


def test_pipe2_sequence2_moe_gpt():
    """The demo MoE GPT (all experts on each rank), Ulysses, ZeRO 3: the summed balance loss rides
    with each slice's hidden states (one float more per message: tests/pipe/test_pipe_expert.py)."""
    results = run("moe-gpt", 4, 3, sequence=2)
    one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=2, kv_heads=2, head_dim=8, degree=2, element_size=4)
    for _, tallies, *_ in results:
        for tally in tallies:
            assert (tally["all_to_all"], tally["pipe"]) == (2 * GAS * one, GAS * (activation_bytes(2) + 4)), tally


# ---------------------------------------------------------------------------------------- pipe x tensor

@pytest.mark.parametrize("family, stage", [("gpt2", 1), ("llama-kv2", 3)])
def test_pipe2_tensor2_bytes_of_each_stage(family, stage):
    """The tensor axis' bytes of each stage (the schedule log), per micro-batch with A = micro x seq x
    hidden floats: the first stage's forward all-reduces the vocab-parallel embedding and each of its
    block's two row-parallel outputs (3 A), its backward the block's two shared column inputs' gradients
    (2 A); the last stage's forward its block's 2 A and the gathered logits (micro x seq x vocab), its
    backward 2 A and the head's input gradient (A). Hugging Face GPT-2's head is tied to `wte` across
    the stages (the tie kept on the vocab-parallel slices), the Llama has 4 query over 2 key/value heads."""
    results = run(family, 4, stage, tensor=2)
    a, logits = activation_bytes(), 4 * MICRO * SEQ * VOCAB
    expected = {0: (GAS * 3 * a, GAS * 2 * a), 1: (GAS * (2 * a + logits), GAS * 3 * a)}
    for _, tallies, degrees, pipe_rank, *_ in results:
        assert degrees["tensor"] == 2 and degrees["pipe"] == 2
        for tally in tallies:
            assert tally["tensor"] == expected[pipe_rank], (pipe_rank, tally)
            assert tally["pipe"] == GAS * activation_bytes(), tally  # the replicated hidden states


# ---------------------------------------------------------------------------------------- pipe x expert

@pytest.mark.timeout(600)  # the 8-rank triple: about 3-5 min on the shared 2-core machine
@pytest.mark.parametrize("stage, data", [(1, 1), (3, 1), (3, 2)])
def test_pipe2_expert2_bytes_and_the_triple_with_data_at_zero_3(stage, data):
    """pipe 2 x expert 2 (4 ranks), and the triple pipe 2 x data 2 x expert 2 (8 ranks) at ZeRO 3
    (tests/pipe/test_pipe_expert.py has it at ZeRO 1): the batch dealt over data x expert; per
    micro-batch the stage's one MoE layer moves 4 all-to-alls of E x C x hidden over its expert
    group of 2 (C = the call's tokens), the pipe the hidden states and the summed balance loss."""
    from zerodist.train.report import expected_bus_bytes

    results = run("moe-gpt", 4 * data, stage, shards=2 * data, expert=EXPERTS, timeout=280 * data)
    tokens = MICRO * SEQ
    moe = GAS * 4 * EXPERTS * tokens * HIDDEN * 4 / 2  # bus factor (P-1)/P over the expert group of 2
    for _, tallies, degrees, _, _, groups in results:
        assert degrees == {"pipe": 2, "data": data, "expert": 2, "sequence": 1, "tensor": 1}, degrees
        # the data axis: ZeRO over each flat group's ranks (dense over data x expert, experts over data),
        # zero.md's formula for one accumulation step (the stage's buckets reduced once per batch)
        zero = sum(expected_bus_bytes(stage=stage, psi=psi, world_size=ranks, accumulation_steps=1,
                                      reduce_scatter=True, element_bytes=4) for psi, ranks in groups)
        for tally in tallies:
            assert (tally["all_to_all"], tally["pipe"]) == (moe, GAS * (activation_bytes() + 4)), tally
            assert tally["zero_all"] == zero, (tally, groups)


# ---------------------------------------------------------------------------------------- pipe x data

@pytest.mark.parametrize("stage", [1, 3])
def test_pipe2_data2_llama_zero_bytes(stage):
    """pipe 2 x data 2 on Hugging Face Llama: each stage's flat groups are reduced once per batch (after
    the rank's last REDUCE_GRAD) over the stage's data group, and at ZeRO 3 each stage is gathered once
    per batch (one stage per rank: in flight from its first forward to its last backward), so the data
    axis' bytes are docs/design/zero.md's formula for one accumulation step with this stage's Ψ."""
    from zerodist.train.report import expected_bus_bytes

    results = run("llama", 4, stage, shards=2)
    for _, tallies, degrees, _, psi, _ in results:
        assert degrees == {"pipe": 2, "data": 2, "expert": 1, "sequence": 1, "tensor": 1}, degrees
        expected = expected_bus_bytes(stage=stage, psi=psi, world_size=2, accumulation_steps=1, reduce_scatter=True,
                                      element_bytes=4)
        for tally in tallies:
            assert (tally["zero"], tally["pipe"]) == (expected, GAS * activation_bytes()), (tally, expected)


# ---------------------------------------------------------------------------------------- the triple's three axes

@pytest.mark.timeout(600)  # 8 ranks of 3 axes: about 5 min on the shared 2-core machine
@pytest.mark.parametrize("stage", [1, 3])
def test_pipe2_tensor2_sequence2_bytes_of_all_three_axes(stage):
    """The triple pipe 2 x tensor 2 x sequence 2 on 8 ranks (Hugging Face Llama, 4 query over 2
    key/value heads, Ulysses, ZeRO 1 and 3), each axis' bytes: Ulysses over the heads a tensor rank holds,
    the tensor axis' per stage as in test_pipe2_tensor2_bytes_of_each_stage over the slice's tokens,
    and the pipe's slices (tests/pipe/test_pipe_sequence.py checks the first and the last)."""
    results = run("llama-kv2", 8, stage, sequence=2, tensor=2, timeout=560)
    one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=2, kv_heads=1, head_dim=4, degree=2, element_size=4)
    a, logits = activation_bytes(2), 4 * MICRO * (SEQ // 2) * VOCAB
    expected = {0: (GAS * 3 * a, GAS * 2 * a), 1: (GAS * (2 * a + logits), GAS * 3 * a)}
    for _, tallies, degrees, pipe_rank, *_ in results:
        assert degrees == {"pipe": 2, "data": 1, "expert": 1, "sequence": 2, "tensor": 2}, degrees
        for tally in tallies:
            assert (tally["all_to_all"], tally["tensor"], tally["pipe"]) == (2 * GAS * one, expected[pipe_rank], GAS * a)
