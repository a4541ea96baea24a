"""Named errors of sequence parallelism, raised on every rank before a collective could hang, and
the data-loader adapter's slices."""

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.sequence import SequenceLayout, SequenceParallelError, hf
from zerodist.sequence.data import shard_batch, shift_labels
from tests.harness import distributed_test
from tests.hf_models import hf_class, hf_config

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10**9,
          "sequence_parallel_size": 2}


@pytest.mark.unit
def test_shard_batch_slices_shifts_and_numbers():
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, 3] = -100
    mine = shard_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8)}, SequenceLayout(1, 2))
    assert sorted(mine) == ["input_ids", "labels", "position_ids", "shift_labels"]  # the all-ones mask dropped
    assert mine["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert mine["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    assert mine["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]  # shifted before the split
    assert shift_labels(labels)[0, 2] == -100
    ring = shard_batch((ids, labels), SequenceLayout(0, 2, head_tail=True))
    assert ring[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]] and ring[2].tolist() == [[0, 1, 6, 7]] * 2
    with pytest.raises(SequenceParallelError, match="sequence length 8 is not divisible by 3 sequence-parallel"):
        shard_batch((ids,), SequenceLayout(0, 3))
    with pytest.raises(SequenceParallelError, match="attention_mask with padding"):
        shard_batch({"input_ids": ids, "attention_mask": torch.zeros(2, 8)}, SequenceLayout(0, 2))


@distributed_test(world_size=2, timeout=60)
def test_heads_not_divisible_names_the_ring():
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, d_model=12, n_layers=1, n_heads=3))
    with pytest.raises(SequenceParallelError, match="3 heads are not divisible by sequence_parallel_size=2.*ring"):
        zerodist.initialize(model=model, config=CONFIG)
    # the ring takes any degree
    ring = {**CONFIG, "zerodist": {"sequence_parallel": {"method": "ring"}}}
    engine = zerodist.initialize(model=GPT(GPTConfig(vocab_size=16, seq_len=8, d_model=12, n_layers=1, n_heads=3)),
                                 config=ring)[0]
    engine.destroy()


@distributed_test(world_size=2, timeout=60)
def test_missing_position_ids_and_unshifted_labels():
    engine = zerodist.initialize(model=GPT(GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_layers=1, n_heads=2)),
                                 config=CONFIG)[0]
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(SequenceParallelError, match="without position_ids"):
        engine(ids, ids)
    engine.destroy()
    llama = hf_class("llama")(hf_config("llama"))
    engine = zerodist.initialize(model=llama, config=CONFIG)[0]
    other = zerodist.initialize(model=hf_class("llama")(hf_config("llama")), config=CONFIG)[0]
    with pytest.raises(SequenceParallelError, match="labels but no shift_labels"):
        engine(input_ids=ids, labels=ids, position_ids=torch.arange(4)[None])
    engine.destroy()
    assert llama.config._attn_implementation == "eager"  # destroy() gave the model its attention back
    assert hf.is_registered()  # the other engine's model still runs it
    other.destroy()
    assert not hf.is_registered()  # nothing of zerodist left in transformers' global registries
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    assert hf.ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return {"input_ids": torch.arange(8) + 100 * index, "labels": torch.arange(8) + 100 * index}


@distributed_test(world_size=2, timeout=60)
def test_engine_loader_hands_each_rank_its_slice():
    engine, _, loader, _ = zerodist.initialize(model=hf_class("llama")(hf_config("llama", vocab_size=1000)),
                                               config=CONFIG, training_data=_Samples())
    batch = next(iter(loader))
    everyone = [None, None]
    comm.all_gather_object(everyone, {k: v.tolist() for k, v in batch.items()})
    rank = comm.get_rank()
    assert batch["position_ids"].tolist() == [list(range(4 * rank, 4 * rank + 4))] * 2
    whole = [a + b for a, b in zip(everyone[0]["input_ids"], everyone[1]["input_ids"])]
    assert all(row == [row[0] + i for i in range(8)] for row in whole)  # the same samples, split in order
    assert batch["shift_labels"].tolist() == [[x + 1 for x in row[4 * rank:4 * rank + 4]] if rank == 0 else
                                              [x + 1 for x in row[4:7]] + [-100] for row in whole]
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    engine.destroy()
