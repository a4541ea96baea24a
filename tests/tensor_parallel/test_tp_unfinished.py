"""A block's unfinished output ([Note: unfinished outputs] in zerodist/utils/unfinished.py): the chunk
runner calls back once every chunk has left a block call, in the main thread, between turns; and the
Hugging Face plan keeps an embedding with a forward of its own (Gemma's scaled rows) whole."""

from __future__ import annotations

import threading

import pytest
import torch

from zerodist.tensor_parallel.chunks import ChunkRunner, chunk_turn
from zerodist.tensor_parallel.layers import VocabParallelEmbedding
from zerodist.tensor_parallel.operators import TensorRegion
from zerodist.tensor_parallel.plans import hf_llama_plan

pytestmark = pytest.mark.unit


def parks_once(events: list[str], name: str):
    """An item that parks once (as at a reduction), then returns its value + 1."""
    def item(value):
        chunk = chunk_turn()
        events.append(f"{name} chunk {chunk.index} parks")
        chunk.issues += 1
        chunk.park()
        events.append(f"{name} chunk {chunk.index} done")
        return value + 1
    return item


def test_when_done_fires_in_the_main_thread_after_the_last_chunk_left_the_block():
    events: list[str] = []
    fired: list[tuple[list, str]] = []
    runner = ChunkRunner([torch.zeros(1), torch.ones(1)])
    try:
        runner.submit([parks_once(events, "block 0")] * 2)
        runner.run(lambda chunk: chunk.issues >= 1)  # every chunk parked in block 0, as under inter

        def callback(values):
            fired.append((values, threading.current_thread().name))
            events.append("fired")

        runner.when_done(0, callback)
        assert not fired
        runner.submit([parks_once(events, "block 1")] * 2)
        runner.run()
        values, thread = fired[0]
        assert len(fired) == 1 and thread == threading.main_thread().name
        assert [v.item() for v in values] == [1.0, 2.0]  # each chunk's output of block 0, not of block 1
        assert runner.values()[0].item() == 2.0
        # chunk 1 left block 0 in its second turn (then parked in block 1): fired right after that turn
        at = events.index("fired")
        assert events[at - 2:at + 2] == ["block 0 chunk 1 done", "block 1 chunk 1 parks", "fired",
                                         "block 1 chunk 0 done"], events
    finally:
        runner.close()


def test_when_done_on_a_finished_block_fires_at_once_and_a_closed_runner_drops_it():
    runner = ChunkRunner([torch.zeros(1), torch.ones(1)])
    fired: list[list] = []
    runner.submit([lambda value: value + 1] * 2)
    runner.run()
    runner.when_done(0, fired.append)
    assert [v.item() for v in fired[0]] == [1.0, 2.0]
    runner.submit([parks_once([], "block 1")] * 2)
    runner.run(lambda chunk: chunk.issues >= 1)
    runner.when_done(1, fired.append)
    runner.close()  # the forward abandoned between blocks: nobody is called back
    assert len(fired) == 1


class ScaledEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 4.0


def test_an_embedding_with_a_forward_of_its_own_is_not_made_vocab_parallel():
    with pytest.raises(ValueError, match="forward of its own"):
        VocabParallelEmbedding.from_embedding(ScaledEmbedding(8, 4), TensorRegion(group=None, size=2, rank=0))  # type: ignore[arg-type]
    from tests.hf_models import small_hf_model

    gemma = small_hf_model("gemma2", layers=1, vocab=16, seq=8)  # Gemma2TextScaledWordEmbedding
    plan = hf_llama_plan(gemma)
    assert "model.embed_tokens" not in plan and plan["lm_head"] == "colwise_rep"
    assert hf_llama_plan(small_hf_model("llama", layers=1, vocab=16, seq=8))["model.embed_tokens"] == "vocab"
