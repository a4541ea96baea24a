"""Domino on any model with a plan (a layer_specs Llama-style model, Hugging Face Llama and GPT-2):
the chunks take turns through each block's own forward; against plain tensor parallelism."""

import copy

import pytest
import torch

import zerodist.comm as comm
from zerodist.tensor_parallel import (
    DominoChunkError,
    DominoConfig,
    DominoJoinError,
    DominoStreamError,
    DominoTurns,
    apply_domino,
    find_blocks,
    parallelize,
    schedule_log,
    unsliced_gradients,
    unsliced_state_dict,
)
from tests.harness import distributed_test
from tests.tensor_parallel.test_tp_parallelize import _batches
from tests.tensor_parallel.test_tp_shared_input import tiny

pytestmark = pytest.mark.multiprocess

BATCH, SEQ = 6, 8  # divisible by k = 2 and 3


def _pair(kind, config, dtype=torch.float32):
    model, plan, loss_of, vocab = tiny(kind, dtype)
    topology = comm.Topology(tensor=2)
    plain = parallelize(copy.deepcopy(model), plan, topology)
    domino = parallelize(copy.deepcopy(model), plan, topology)
    blocks = find_blocks(domino)
    apply_domino(blocks, None, None, config)
    return plain, domino, blocks, loss_of, vocab


@distributed_test(world_size=2, timeout=180)
@pytest.mark.parametrize("kind", ["llama_like", "llama", "gpt2"])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("overlap", ["intra", "inter"])
def test_domino_matches_plain_tensor_parallel_for_three_sgd_steps(kind, chunks, overlap):
    plain, domino, blocks, loss_of, vocab = _pair(kind, DominoConfig(chunks, overlap))
    assert all(isinstance(block, DominoTurns) for block in blocks)
    assert domino.state_dict().keys() == plain.state_dict().keys()  # the same names as without Domino
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, domino)]
    for idx, targets in _batches(3, BATCH, SEQ, vocab):
        losses = [loss_of(m, idx, targets) for m in (plain, domino)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
        expected, actual = unsliced_gradients(plain), unsliced_gradients(domino)
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    reference = unsliced_state_dict(plain)
    for name, value in unsliced_state_dict(domino).items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


@distributed_test(world_size=2, timeout=120)
@pytest.mark.parametrize("kind", ["llama_like", "llama", "gpt2"])
@pytest.mark.parametrize("overlap", ["intra", "inter"])
def test_domino_bytes_and_overlap_from_the_schedule_log(kind, overlap):
    plain, domino, _, loss_of, vocab = _pair(kind, DominoConfig(2, overlap))
    idx, targets = _batches(1, BATCH, SEQ, vocab)[0]
    with schedule_log() as plain_log:
        loss_of(plain, idx, targets).backward()
    with schedule_log() as log, comm.trace() as recorded:
        loss_of(domino, idx, targets).backward()
    tokens, hidden, layers = BATCH * SEQ, 32, 2
    # Every row-parallel reduction of the blocks runs asynchronously, in 2 chunks of T*h/2 each.
    assert log.issued_sizes("forward") == [tokens * hidden * 4 // 2] * (2 * 2 * layers)
    # The same bytes as plain tensor parallelism, forward and backward.
    assert log.all_bytes("forward") == plain_log.all_bytes("forward")
    assert log.all_bytes("backward") == plain_log.all_bytes("backward")
    assert recorded.count("all_reduce") > 0
    # inter: every chunk's reduction waits under another chunk's compute; intra: all but the last
    # chunk's last reduction of each block.
    fraction = log.overlap_fraction("forward")
    assert fraction == 1.0 if overlap == "inter" else fraction >= 0.5


@distributed_test(world_size=2)
def test_domino_on_any_model_named_errors_and_threads_ended():
    import threading

    plain, domino, _, loss_of, vocab = _pair("llama_like", DominoConfig(4, "inter"))
    idx, targets = _batches(1, BATCH, SEQ, vocab)[0]
    with pytest.raises(DominoChunkError, match="splits the batch into 4 chunks, but the batch has 6"):
        loss_of(domino, idx, targets)
    _, domino, blocks, loss_of, vocab = _pair("llama_like", DominoConfig(2, "inter"))
    hidden = domino.embed_tokens(idx)
    stream = blocks[0](hidden)
    # its metadata is the input's (glue between blocks reads the shape); its values are the next block's
    assert (stream.shape, stream.dtype, stream.device) == (hidden.shape, hidden.dtype, hidden.device)
    with pytest.raises(DominoStreamError, match="between Domino blocks"):
        stream.sum()
    del stream  # an abandoned forward: its chunks' threads are ended
    loss_of(domino, idx, targets).backward()
    assert not [t for t in threading.enumerate() if t.name.startswith("zerodist-domino-chunk")]
    with pytest.raises(ValueError, match="already runs the Domino schedule"):
        apply_domino(blocks, None, None, DominoConfig(2))


class _AuxBlock(torch.nn.Module):
    """A block returning (hidden, a 0-dim auxiliary loss: the sum of its squares over the tokens)."""

    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        y = x + self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))
        return y, y.pow(2).sum()


def _aux_model():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_AuxBlock(), _AuxBlock()])
    return parallelize(model, {"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"}, comm.Topology(tensor=2))


@distributed_test(world_size=2, timeout=120)
def test_a_0_dim_block_output_is_refused_unless_its_join_is_declared():
    """[Note: Domino's scalar join]: no join is right for every 0-dim output (a sum, a mean, an MoE balance
    loss), so Domino refuses one by name; a declared join ("sum" for a sum over tokens) is exact."""
    plain, refused, summed = _aux_model(), _aux_model(), _aux_model()
    apply_domino(refused.blocks, None, None, DominoConfig(2, "intra"))
    apply_domino(summed.blocks, None, None, DominoConfig(2, "intra"), scalar_join="sum")
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    with pytest.raises(DominoJoinError, match="scalar_join='mean' or 'sum'"):
        refused.blocks[0](x)
    (expected, expected_aux), (actual, actual_aux) = plain.blocks[0](x), summed.blocks[0](x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(actual_aux, expected_aux, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="scalar_join must be one of"):
        apply_domino(_aux_model().blocks, None, None, DominoConfig(2, "intra"), scalar_join="max")
