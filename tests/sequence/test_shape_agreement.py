"""Issue 37 item 3: ranks that disagree on a sequence-parallel shape get `CollectiveMismatchError`
on every rank, naming each rank's shapes, where gloo aborted one process before
(`EnforceNotMet ... Received data size doesn't match`, SIGABRT): `DistributedAttention` with 8 vs
12 tokens and with 4 vs 2 heads, `RingAttention` with 8 vs 12 tokens, and the engine with 64 vs 48
tokens at step 2. After the error the group is still usable (nothing was half-exchanged)."""

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.comm import CollectiveMismatchError
from zerodist.comm.agree import SLOTS, _encode
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.sequence import DistributedAttention, RingAttention, SequenceLayout
from zerodist.sequence.data import shard_batch
from tests.harness import distributed_test
from tests.sequence.test_attention import local_causal


def _group_still_works():
    ones = torch.ones(3)
    comm.all_reduce(ones)
    assert ones.tolist() == [2.0] * 3


@pytest.mark.parametrize("tokens,heads,match", [((8, 12), (4, 4), r"rank 0: \[\(2, 8, 4, 8\).*rank 1: \[\(2, 12, 4, 8\)"),
                                                ((8, 8), (4, 2), r"rank 0: \[\(2, 8, 4, 8\).*rank 1: \[\(2, 8, 2, 8\)")])
@distributed_test(world_size=2, timeout=60)
def test_distributed_attention_disagreement_is_named_on_every_rank(tokens, heads, match):
    rank = comm.get_rank()
    attention = DistributedAttention(local_causal, comm.get_world_group(), scatter_idx=2, gather_idx=1)
    q = torch.randn(2, tokens[rank], heads[rank], 8)
    with pytest.raises(CollectiveMismatchError, match="DistributedAttention's q, k, v.*" + match):
        attention(q, q, q)
    _group_still_works()


@distributed_test(world_size=2, timeout=60)
def test_ring_attention_disagreement_is_named_on_every_rank():
    rank = comm.get_rank()
    q = torch.randn(2, (8, 12)[rank], 2, 8)
    with pytest.raises(CollectiveMismatchError, match=r"RingAttention's q, k, v.*rank 1: \[\(2, 12, 2, 8\)"):
        RingAttention(comm.get_world_group())(q, q, q)
    _group_still_works()


@distributed_test(world_size=2, timeout=90)
def test_engine_with_64_vs_48_tokens_at_step_2_is_named_on_every_rank():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=64, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10**9,
              "sequence_parallel_size": 2}
    engine = zerodist.initialize(model=model, config=config)[0]
    layout = SequenceLayout(comm.get_rank(), 2)
    for step, tokens in enumerate((64, 64 if comm.get_rank() == 0 else 48)):
        ids = torch.randint(0, 16, (2, tokens), generator=torch.Generator().manual_seed(step))
        batch = shard_batch((ids, ids), layout)
        if step == 0:
            engine.backward(engine(*batch))
            engine.step()
            continue
        with pytest.raises(CollectiveMismatchError, match=r"GPT's forward.*rank 0: \[\(2, 32\).*rank 1: \[\(2, 24\)"):
            engine(*batch)
    _group_still_works()
    engine.destroy()


@pytest.mark.unit
def test_encoding_is_fixed_length_and_digests_long_shapes():
    assert _encode([(2, 8, 4, 8)]) == [1, 4, 2, 8, 4, 8] + [-1] * (SLOTS - 6)
    many = [(i, i + 1) for i in range(12)]
    long, other = _encode(many), _encode(many[:-1] + [(11, 13)])
    assert len(long) == len(other) == SLOTS and long[:-1] == other[:-1] and long[-1] != other[-1]
