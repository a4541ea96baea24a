"""Domino: k-chunk overlapped tensor parallelism against plain tensor parallelism and one process."""

import copy
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

import zerodist.comm as comm
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.tensor_parallel import (
    DominoBlock,
    DominoChunkError,
    DominoConfig,
    gpt_domino,
    gpt_plan,
    parallelize,
    schedule_log,
)
from tests.harness import distributed_test
from tests.tensor_parallel.test_tp_parallelize import _batches, _train_and_compare

pytestmark = pytest.mark.multiprocess

SHAPE = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
BATCH = 6  # divisible by k = 2 and 3


def _models(world_size, dtype, domino):
    topology = comm.Topology(tensor=world_size)
    torch.manual_seed(0)
    reference = GPT(SHAPE).to(dtype)
    parallel = parallelize(copy.deepcopy(reference), gpt_plan(), topology)
    if domino is not None:
        gpt_domino(parallel, topology, domino)
    return topology, reference, parallel


@distributed_test(world_size=2)
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("overlap", ["intra", "inter"])
def test_domino_matches_plain_tensor_parallel_and_one_process(chunks, overlap):
    topology, reference, domino = _models(2, torch.float64, DominoConfig(chunks, overlap))
    _, _, plain = _models(2, torch.float64, None)
    assert isinstance(domino.blocks[0], DominoBlock)
    assert domino.state_dict().keys() == plain.state_dict().keys()  # same names as without Domino
    idx, targets = _batches(1, BATCH, 8, 64)[0]
    torch.testing.assert_close(domino(idx, targets), plain(idx, targets), rtol=1e-12, atol=1e-12)
    _train_and_compare(reference, domino, topology, _batches(3, BATCH, 8, 64), torch.float64,
                       lambda model, i, t: model(i, t))


def _all_reduce_sizes(recorded):
    return Counter(r.numel for r in recorded.records if r.op == "all_reduce")


@distributed_test(world_size=2)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_tensor_parallel_bytes_equal_the_formula(chunks):
    domino = DominoConfig(chunks, "inter") if chunks > 1 else None
    _, _, model = _models(2, torch.float32, domino)
    idx, targets = _batches(1, BATCH, 8, 64)[0]
    tokens, hidden, layers = BATCH * 8, SHAPE.d_model, SHAPE.n_layers
    with schedule_log() as log:
        with comm.trace() as forward:
            loss = model(idx, targets)
        with comm.trace() as backward:
            loss.backward()
    # The schedule log sees every tensor-parallel byte, in the phase it belongs to.
    assert log.all_bytes("forward") == forward.total_bytes() and log.all_bytes("backward") == backward.total_bytes()
    # Per block: 2 all-reduces forward and 2 backward of T*h elements (plain), 2k + 2k of T*h/k
    # (Domino); per model: the vocab-parallel embedding's forward all-reduce and the gathered
    # LM head's forward all-gather (T*V) and backward input-gradient all-reduce (T*h).
    per_block = Counter({tokens * hidden // chunks: 2 * chunks * layers})
    assert _all_reduce_sizes(forward) == per_block + Counter({tokens * hidden: 1})
    assert [(r.op, r.numel) for r in forward.records if r.op != "all_reduce"] == [("all_gather", tokens * 64)]
    assert _all_reduce_sizes(backward) == per_block + Counter({tokens * hidden: 1})
    assert backward.count() == backward.count("all_reduce")
    assert forward.total_bytes("all_reduce") == 4 * (tokens * hidden * 2 * layers + tokens * hidden)


@distributed_test(world_size=2)
@pytest.mark.parametrize("overlap", ["intra", "inter"])
def test_schedule_overlap_from_the_event_order(overlap):
    _, _, model = _models(2, torch.float32, DominoConfig(2, overlap))
    idx, targets = _batches(1, BATCH, 8, 64)[0]
    with schedule_log() as log:
        model(idx, targets).backward()
    tokens, hidden, layers = BATCH * 8, SHAPE.d_model, SHAPE.n_layers
    assert log.total_bytes("forward") == 4 * tokens * hidden * 2 * layers  # every row-parallel reduction
    assert log.overlap_fraction("forward") >= (0.9 if overlap == "inter" else 0.5)
    # Every column-parallel input-gradient all-reduce waits after its weight-gradient matmul.
    assert log.overlap_fraction("backward") == 1.0
    windows = log.windows("forward")
    if overlap == "inter":  # the last chunk of block 0 waits under block 1's first chunk
        assert all(computes >= 1 for _, computes, _ in windows)


@distributed_test(world_size=2)
def test_uneven_batch_and_bad_settings_are_named_errors():
    _, _, model = _models(2, torch.float32, DominoConfig(4, "inter"))
    idx, targets = _batches(1, BATCH, 8, 64)[0]
    with pytest.raises(DominoChunkError, match="splits the batch into 4 chunks, but the batch has 6"):
        model(idx, targets)
    with pytest.raises(ValueError, match="chunks must be an int >= 2"):
        DominoConfig(1)
    with pytest.raises(ValueError, match="overlap must be 'intra' or 'inter'"):
        DominoConfig(2, "cross")
    topology = comm.Topology(tensor=2)
    sequence = parallelize(GPT(SHAPE), gpt_plan(sequence_parallel=True), topology, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence-parallel layers"):
        gpt_domino(sequence, topology, DominoConfig(2))


_PLAIN_PROCESS = """
import torch, zerodist.comm as comm
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.tensor_parallel import DominoConfig, gpt_domino, gpt_plan, parallelize
assert not comm.is_initialized()
model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2))
topology = comm.Topology(tensor=1)
gpt_domino(parallelize(model, gpt_plan(), topology), topology, DominoConfig(2, "inter"))
loss = model(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
loss.backward()
print("ok", comm.get_world_size(), round(loss.item(), 3))
"""


def test_domino_runs_in_a_plain_process_without_init_distributed():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", _PLAIN_PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok 1 ")


@distributed_test(world_size=2)
def test_sequence_parallel_bytes_equal_the_formula():
    topology = comm.Topology(tensor=2)
    torch.manual_seed(0)
    model = parallelize(GPT(SHAPE), gpt_plan(sequence_parallel=True), topology, sequence_parallel=True)
    idx, targets = _batches(1, BATCH, 8, 64)[0]
    tokens, hidden, layers, seq = BATCH * 8, SHAPE.d_model, SHAPE.n_layers, 8
    with comm.trace() as forward:
        loss = model(idx, targets)
    with comm.trace() as backward:
        loss.backward()
    sizes = lambda trace, op: Counter(r.numel for r in trace.records if r.op == op)  # noqa: E731
    # Forward: every column layer (2 per block, and the LM head) all-gathers its sequence-split
    # input, every row layer (2 per block, and the vocab embedding) reduce-scatters its output;
    # the LM head also gathers the vocabulary (T x V). No all-reduce.
    assert sizes(forward, "all_gather") == Counter({tokens * hidden: 2 * layers + 1, tokens * 64: 1})
    assert sizes(forward, "reduce_scatter") == Counter({tokens * hidden: 2 * layers + 1})
    # Backward: the adjoints (column inputs reduce-scattered, row outputs and the embedding
    # all-gathered; the gathered input is kept, so no re-gather), plus the positional embedding's
    # split (S x h, all-gathered back).
    assert sizes(backward, "reduce_scatter") == Counter({tokens * hidden: 2 * layers + 1})
    assert sizes(backward, "all_gather") == Counter({tokens * hidden: 2 * layers + 1, seq * hidden: 1})
    assert forward.count("all_reduce") == 0 and backward.count("all_reduce") == 0
