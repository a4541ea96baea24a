"""Checkpoints of tensor-parallel engines: saved at data=2 x tensor=2, loaded at tensor 1, 2 and 4."""

from pathlib import Path

import pytest
import torch

import zerodist
from zerodist.checkpoint import consolidate_checkpoint
from zerodist.checkpoint.manifest import read_manifest
from zerodist.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess

# vocab 62: split evenly at tensor 2, padded to 64 at tensor 4 (embedding and gathered LM head)
SHAPE = GPTConfig(vocab_size=62, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=32)
MICRO_GLOBAL = 4  # sequences per step over all data shards


def _config(stage, tensor):
    return {
        "train_batch_size": MICRO_GLOBAL, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
        "gradient_clipping": 0.5, "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tensor},
    }


def _engine(stage, tensor):
    torch.manual_seed(0)
    return zerodist.initialize(model=GPT(SHAPE), config=_config(stage, tensor))[0]


def _steps(engine, first, last):
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    micro = MICRO_GLOBAL // shards
    for step in range(first, last):
        generator = torch.Generator().manual_seed(700 + step)
        idx = torch.randint(0, 62, (MICRO_GLOBAL, 8), generator=generator)
        targets = torch.randint(0, 62, (MICRO_GLOBAL, 8), generator=generator)
        rows = slice(shard * micro, (shard + 1) * micro)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()


def _save_at_2x2(path, stage):
    engine = _engine(stage, tensor=2)
    _steps(engine, 0, 3)
    engine.save_checkpoint(path)
    saved = engine.module_state_dict()
    _steps(engine, 3, 6)  # uninterrupted
    return saved, engine.module_state_dict()


def _load_and_resume(path, stage, tensor):
    engine = _engine(stage, tensor)
    engine.load_checkpoint(path)
    assert engine.global_steps == 3
    loaded = engine.module_state_dict()
    _steps(engine, 3, 6)
    return loaded, engine.module_state_dict(), dict(engine.topology.degrees)


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", [1, 3])
def test_save_at_data2_tensor2_and_load_at_tensor_1_2_and_4(tmp_path, stage):
    saved, uninterrupted = run_distributed(_save_at_2x2, 4, str(tmp_path), stage, timeout=240)[0]
    consolidated = consolidate_checkpoint(tmp_path)  # the unsliced model, no process group
    assert consolidated.keys() == saved.keys()
    for key in saved:
        assert torch.equal(consolidated[key], saved[key]), key

    for world, tensor, load_stage in [(4, 2, stage), (1, 1, stage), (2, 1, 3 - stage + 1), (4, 4, stage)]:
        results = run_distributed(_load_and_resume, world, str(tmp_path), load_stage, tensor, timeout=240)
        loaded, resumed, degrees = results[0]
        assert degrees["tensor"] == tensor
        for key in saved:  # pure slicing: bitwise at every degree and stage
            assert torch.equal(loaded[key], saved[key]), (world, tensor, key)
        # Same layout: the resumed run is the uninterrupted one; another layout: fp32 rounding.
        tolerance = 1e-6 if (world, tensor, load_stage) == (4, 2, stage) else 1e-5
        for key in saved:
            assert _relative(resumed[key], uninterrupted[key]) <= tolerance, (world, tensor, key)


def _dropout_resume(path):
    dropout = GPTConfig(**{**SHAPE.__dict__, "dropout": 0.2})

    def build():
        torch.manual_seed(0)
        return zerodist.initialize(model=GPT(dropout), config=_config(1, tensor=2))[0]

    engine = build()
    _steps(engine, 0, 2)
    engine.save_checkpoint(path)
    _steps(engine, 2, 4)
    uninterrupted = engine.module_state_dict()
    resumed = build()
    resumed.load_checkpoint(path)
    _steps(resumed, 2, 4)
    after = resumed.module_state_dict()
    return all(torch.equal(after[k], uninterrupted[k]) for k in after)


def test_dropout_streams_are_saved_and_resumed_bitwise(tmp_path):
    # Attention dropout draws from the tracker's per-tensor-rank stream, the rest from torch's
    # default one: a resume at the same layout restores both, so the run continues bitwise.
    assert run_distributed(_dropout_resume, 4, str(tmp_path), timeout=240) == [True] * 4


FROZEN = ("attn.", "tok_emb.")  # sliced by tensor parallelism (qkv and the vocab by columns, proj by rows)


def _frozen_engine(stage, tensor):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    for name, param in model.named_parameters():
        param.requires_grad_(not any(part in name for part in FROZEN))
    return zerodist.initialize(model=model, config=_config(stage, tensor))[0]


def _save_frozen(path, stage):
    engine = _frozen_engine(stage, tensor=2)
    _steps(engine, 0, 2)
    engine.save_checkpoint(path)
    return engine.module_state_dict()


def _frozen_writers(path):
    engine = _frozen_engine(3, tensor=2)
    _steps(engine, 0, 1)
    engine.save_checkpoint(path)
    return engine.topology.axis_rank("tensor"), engine.module_state_dict()


def test_each_frozen_value_is_written_by_a_rank_of_tensor_index_0_spread_over_the_data_ranks(tmp_path):
    """data 2 x tensor 2 at ZeRO-3: a frozen value is the same on every rank once joined, so only
    ranks at tensor index 0 copy and write it, taking the groups in turn (both data ranks write)."""
    results = run_distributed(_frozen_writers, 4, str(tmp_path), timeout=240)
    tensor_zero = {f"r{rank:05d}" for rank, (index, _) in enumerate(results) if index == 0}
    extra = read_manifest(Path(tmp_path) / "global_step1").extra
    frozen = {key: entry["file"].split("-")[1] for key, entry in extra.items() if any(p in key for p in FROZEN)}
    assert frozen and set(frozen.values()) == tensor_zero, (frozen, tensor_zero)
    saved, consolidated = results[0][1], consolidate_checkpoint(tmp_path)
    for key in frozen:
        assert torch.equal(consolidated[key], saved[key]), key


def _load_frozen(path, stage, tensor):
    engine = _frozen_engine(stage, tensor)
    engine.load_checkpoint(path)
    return engine.module_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_sliced_parameters_round_trip_at_every_degree(tmp_path, stage):
    """Frozen parameters that tensor parallelism slices (and ZeRO-3 shards besides): saved at tensor
    2, they are whole in the consolidated checkpoint, unchanged by training, and load bitwise at
    tensor 1 and 2 and at the other stage."""
    saved = run_distributed(_save_frozen, 2, str(tmp_path), stage, timeout=240)[0]
    torch.manual_seed(0)
    initial = GPT(SHAPE).state_dict()
    frozen = [key for key in saved if any(part in key for part in FROZEN)]
    assert frozen and [key for key in frozen if not torch.equal(saved[key], initial[key])] == []
    assert any(not torch.equal(saved[key], initial[key]) for key in saved if key not in frozen)  # it trained
    consolidated = consolidate_checkpoint(tmp_path)
    assert consolidated.keys() == saved.keys()
    assert [key for key in saved if not torch.equal(consolidated[key], saved[key])] == []
    for world, tensor, load_stage in [(1, 1, stage), (2, 2, 4 - stage)]:
        loaded = run_distributed(_load_frozen, world, str(tmp_path), load_stage, tensor, timeout=240)[0]
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), (world, tensor, load_stage, key)


class _WithTable(torch.nn.Module):
    """The GPT plus a buffer whose length a test can change (the check covers every saved extra: a
    sliced frozen parameter from an older save has its slice's shape, a buffer another length)."""

    def __init__(self, length):
        super().__init__()
        self.gpt = GPT(SHAPE)
        self.register_buffer("table", torch.arange(float(length)))

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def _save_then_load_other_shape(path):
    torch.manual_seed(0)
    engine = zerodist.initialize(model=_WithTable(4), config=_config(1, 1))[0]
    engine.save_checkpoint(path)
    before = engine.module_state_dict()
    torch.manual_seed(1)  # other weights: a partial load would show
    other = zerodist.initialize(model=_WithTable(5), config=_config(1, 1))[0]
    untouched = other.module_state_dict()
    try:
        other.load_checkpoint(path)
    except zerodist.checkpoint.CheckpointError as error:
        after = other.module_state_dict()
        same = all(torch.equal(after[k], untouched[k]) for k in after)
        return str(error), same, torch.equal(before["table"], torch.arange(4.0))
    return "loaded", False, False


def test_a_saved_extra_of_another_shape_is_refused_on_every_rank_before_anything_loads(tmp_path):
    for message, untouched, saved in run_distributed(_save_then_load_other_shape, 2, str(tmp_path), timeout=240):
        assert "table is saved with shape (4,), this model's is (5,)" in message
        assert untouched and saved
