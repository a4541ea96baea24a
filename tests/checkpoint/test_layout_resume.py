"""Any layout resumes into any other (issue 31 item 5): a checkpoint saved under one composition of
axes loads under another, parameters and optimizer state, with no offline conversion, and the next
steps equal the uninterrupted run (the saving layout training on) within 1e-6. AdamW throughout,
so a lost or misplaced moment would show in the resumed steps.

- a tiny Hugging Face Llama (4 query over 2 key/value heads), cut by `split_model` and trained at
  pipe 2 x tensor 2 x data 1, ZeRO 1, resumes at data 4 (ZeRO 3) and at sequence 2 x data 2
  (Ulysses, ZeRO 2): one global batch of 4 micro-batches per step in every layout, the mean token
  loss over it;
- the demo MoE GPT at expert 2 x data 2, ZeRO 2, resumes at expert 1 x data 1 (one process,
  ZeRO 1), each micro-batch seen whole by one rank in both (capacity and the balance loss are
  statistics of a rank's own tokens).

Besides the trajectory, the resumed engine saves again at once: its consolidated parameters and
Adam moments equal the saved ones bitwise (the reshard itself moves values, never computes them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, MICRO, SEQ, VOCAB, build, micro_batch
from zerodist.pipe import split_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SAVE_AT, AFTER = 3, 5
KINDS = ("param", "optimizer.exp_avg", "optimizer.exp_avg_sq")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}}


def _config(stage: int, gas: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
            "optimizer": ADAMW, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **extra}


def _llama(scramble: bool = False) -> torch.nn.Module:
    model = build("llama-kv2")
    if scramble:  # other weights: the checkpoint must replace every value
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.5, 0.5)
    return model


# ---------------------------------------------------------------- the Llama under (pipe, tensor, sequence, stage)

@dataclasses.dataclass(frozen=True)
class Layout:
    """4 ranks: data is what pipe x tensor x sequence leaves; `offload`: the optimizer in swap files."""

    pipe: int = 1
    tensor: int = 1
    sequence: int = 1
    stage: int = 1
    offload: bool = False

    @property
    def data(self) -> int:
        return 4 // (self.pipe * self.tensor * self.sequence)

    def config(self, swap_dir: str) -> dict:
        extra: dict = {}
        if self.tensor > 1:
            extra["tensor_parallel"] = {"autotp_size": self.tensor}
        if self.sequence > 1:
            extra["sequence_parallel_size"] = self.sequence
        if self.pipe > 1:
            extra["zerodist"] = {"pipeline": {"schedule": "1f1b"}}
        config = _config(self.stage, GAS // self.data, **extra)
        if self.offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
        return config


def _hf_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    """Micro-batch `micro` of the step's global batch for the model's own loss: the next tokens as
    `shift_labels` (a sequence slice then needs no shifting), the pipeline's token mean."""
    inputs, targets = micro_batch(step, micro, 0)
    targets = targets.contiguous()  # Hugging Face's loss views them flat
    return {"input_ids": inputs, "labels": targets, "shift_labels": targets}


def _llama_step(engine, layout: Layout, step: int) -> None:
    """One step over the global batch: micro-batch g * data + d on data rank d, g < GAS / data."""
    from zerodist.sequence import SequenceLayout
    from zerodist.sequence.data import shard_batch

    shard, micros = engine.topology.batch_rank, range(GAS // layout.data)
    if layout.pipe > 1:
        engine.train_batch(iter([micro_batch(step, g * layout.data + shard, 0) for g in micros]))
        return
    sliced = SequenceLayout(engine.topology.axis_rank("sequence"), layout.sequence) if layout.sequence > 1 else None
    for g in micros:
        batch = _hf_batch(step, g * layout.data + shard)
        engine.backward(engine(**(shard_batch(batch, sliced) if sliced else batch)).loss)
        engine.step()


def llama_body(layout: Layout, path: str, swap_dir: str, again: str | None) -> list[dict[str, torch.Tensor]]:
    """Without `again`: trains SAVE_AT steps, saves at `path`, trains AFTER more (the uninterrupted
    run); with it: loads `path` into other weights, saves at `again` at once, trains the AFTER steps after.
    Each step's state as this rank holds it (the logical model's names; its stage's under a pipeline)."""
    model = _llama(scramble=again is not None)
    if layout.pipe > 1:
        model = split_model(model, num_stages=layout.pipe, split_points=["model.layers.1"])
    engine = zerodist.initialize(model=model, config=layout.config(swap_dir))[0]
    degrees = {"pipe": layout.pipe, "data": layout.data, "expert": 1, "sequence": layout.sequence,
               "tensor": layout.tensor}
    assert dict(engine.topology.degrees) == degrees
    states = []
    if again is not None:
        engine.load_checkpoint(path)
        assert engine.global_steps == SAVE_AT
        engine.save_checkpoint(again)
    for step in range(engine.global_steps, SAVE_AT + AFTER):
        if step == SAVE_AT and again is None:
            engine.save_checkpoint(path)
        _llama_step(engine, layout, step)
        states.append(engine.module_state_dict())
    engine.destroy()
    return states


def _merged(results: list) -> list[dict[str, torch.Tensor]]:
    """Per step, the union of every rank's state (pipeline ranks hold their own stage's keys)."""
    merged: list[dict[str, torch.Tensor]] = [{} for _ in results[0]]
    for states in results:
        for step, state in enumerate(states):
            merged[step].update(state)
    return merged


def _assert_same_state(path, again) -> None:
    for kind in KINDS:
        before, after = ckpt.consolidate_checkpoint(path, kind=kind), ckpt.consolidate_checkpoint(again, kind=kind)
        assert before.keys() == after.keys(), kind
        for key in before:
            assert torch.equal(after[key], before[key]), f"{kind} of {key} changed in the reshard"


def _assert_resumed(resumed: list[dict[str, torch.Tensor]], uninterrupted: list[dict[str, torch.Tensor]]) -> None:
    """`resumed`: one rank's states after each step resumed; `uninterrupted`: the whole model's."""
    assert len(resumed) == AFTER
    for step, (state, expected) in enumerate(zip(resumed, uninterrupted[SAVE_AT:])):
        for key, value in state.items():
            assert torch.allclose(value, expected[key], rtol=0, atol=1e-6), (SAVE_AT + step, key,
                                                                             (value - expected[key]).abs().max().item())
    moved = max((uninterrupted[-1][k] - uninterrupted[SAVE_AT - 1][k]).abs().max().item() for k in uninterrupted[-1])
    assert moved > 1e-3  # the steps compared did train


def _resume(saved: tuple, target: Layout, tmp_path) -> None:
    path, uninterrupted = saved
    (tmp_path / "swap").mkdir()
    results = run_distributed(llama_body, 4, target, str(path), str(tmp_path / "swap"), str(tmp_path / "again"),
                              timeout=240)
    for states in results:
        _assert_resumed(states, uninterrupted)
    assert set(_merged(results)[0]) == set(uninterrupted[0])  # the ranks together hold the whole model
    _assert_same_state(path, tmp_path / "again")


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory):
    """The checkpoint and the uninterrupted run of a layout, made on first use."""
    made: dict[Layout, tuple] = {}

    def get(layout: Layout) -> tuple:
        if layout not in made:
            path, swap = tmp_path_factory.mktemp("saved"), tmp_path_factory.mktemp("swap")
            uninterrupted = _merged(run_distributed(llama_body, 4, layout, str(path), str(swap), None, timeout=240))
            assert set(uninterrupted[0]) == set(build("llama-kv2").state_dict())
            made[layout] = (path, uninterrupted)
        return made[layout]
    return get


PIPE_TENSOR = Layout(pipe=2, tensor=2, stage=1)


@pytest.mark.parametrize("target", [Layout(stage=3), Layout(sequence=2, stage=2)],
                         ids=["data4-zero3", "sequence2-data2-zero2"])
def test_pipe_tensor_checkpoint_resumes_without_pipeline_or_tensor(saved_at, tmp_path, target):
    """Issue 31's acceptance: saved at pipe 2 x tensor 2 x data 1, ZeRO 1."""
    _resume(saved_at(PIPE_TENSOR), target, tmp_path)


@pytest.mark.parametrize("source,target", [
    (Layout(sequence=2, tensor=2, stage=3), Layout(pipe=2, stage=2, offload=True)),
    (Layout(stage=0), Layout(pipe=2, tensor=2, stage=3)),
    (Layout(sequence=2, tensor=2, stage=3), Layout(pipe=2, sequence=2, stage=3)),
], ids=["sequence2-tensor2-zero3-to-pipe2-data2-zero2-offload", "data4-zero0-to-pipe2-tensor2-zero3",
        "sequence2-tensor2-zero3-to-pipe2-sequence2-zero3"])
def test_checkpoint_resumes_into_a_pipeline(saved_at, tmp_path, source, target):
    """The other way: into a pipeline, from sequence x tensor parallelism (its optimizer state
    then in swap files, or into pipe x sequence) and from plain data parallelism (into pipe x
    tensor at ZeRO 3)."""
    _resume(saved_at(source), target, tmp_path)


# ---------------------------------------------------------------- expert 2 x data 2 -> expert 1 x data 1

MOE_BATCH = 4  # micro-batches per step: one per rank at world 4, accumulated on one rank


def _moe_gpt(ep_size: int, scramble: bool = False) -> torch.nn.Module:
    from zerodist.models import GPTConfig
    from zerodist.models.moe_gpt import MoEConfig, MoEGPT

    torch.manual_seed(0)
    model = MoEGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2, d_ff=32),
                   MoEConfig(num_experts=4, ep_size=ep_size, k=1, capacity_factor=1.0, min_capacity=2))
    if scramble:
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.5, 0.5)
    return model


def _moe_steps(engine, first: int, last: int) -> list[dict[str, torch.Tensor]]:
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    states = []
    for step in range(first, last):
        for g in range(MOE_BATCH // shards):
            engine.backward(engine(*micro_batch(step, g * shards + shard, 0)))
            engine.step()
        states.append(engine.module_state_dict())
    return states


def moe_body(path: str, ep_size: int, stage: int, load: bool, again: str | None):
    world = torch.distributed.get_world_size()
    config = {"train_batch_size": MOE_BATCH * MICRO, "train_micro_batch_size_per_gpu": MICRO,
              "steps_per_print": 10**9, "optimizer": ADAMW, "zero_optimization": {"stage": stage}}
    engine = zerodist.initialize(model=_moe_gpt(ep_size, scramble=load), config=config)[0]
    assert engine.topology.degrees["expert"] == ep_size and engine.topology.degrees["data"] == world // ep_size
    if load:
        engine.load_checkpoint(path)
        assert engine.global_steps == SAVE_AT
        engine.save_checkpoint(again)
        states = _moe_steps(engine, SAVE_AT, SAVE_AT + AFTER)
    else:
        states = _moe_steps(engine, 0, SAVE_AT)
        engine.save_checkpoint(path)
        states += _moe_steps(engine, SAVE_AT, SAVE_AT + AFTER)
    engine.destroy()
    return states


def test_expert2_data2_checkpoint_resumes_on_one_process(tmp_path):
    saved, again = tmp_path / "saved", tmp_path / "again"
    uninterrupted = run_distributed(moe_body, 4, str(saved), 2, 2, False, None, timeout=240)[0]
    resumed = run_distributed(moe_body, 1, str(saved), 1, 1, True, str(again), timeout=240)[0]
    _assert_resumed(resumed, uninterrupted)
    _assert_same_state(saved, again)


# ---------------------------------------------------------------- random streams belong to a rank's place in the mesh

def tp_save_body(path: str):
    from tests.tensor_parallel.test_tp_checkpoint import _engine, _steps

    engine = _engine(1, tensor=2)  # data 2 x tensor 2
    _steps(engine, 0, 1)
    engine.save_checkpoint(path)
    engine.destroy()


def tp_load_body(path: str):
    """At tensor 4 on the same 4 ranks: rank 2 was tensor rank 0 and is now 2."""
    from tests.tensor_parallel.test_tp_checkpoint import _engine

    engine = _engine(1, tensor=4)
    fresh = engine.part_states.rng_states()["tensor_parallel"]["sharded"][0].clone()
    torch.manual_seed(100 + torch.distributed.get_rank())
    default = torch.get_rng_state()
    engine.load_checkpoint(path)
    after = engine.part_states.rng_states()["tensor_parallel"]["sharded"][0]
    same = torch.equal(after, fresh), torch.equal(torch.get_rng_state(), default)
    engine.destroy()
    return same


def test_random_streams_are_not_restored_into_another_layout_of_the_same_world_size(tmp_path):
    """Tensor parallelism's `sharded` stream is seeded by the tensor rank: restoring saved rank r's
    into a rank whose tensor rank differs would give two ranks of one tensor group the same
    dropout masks. Another layout starts the streams afresh, as another world size does."""
    run_distributed(tp_save_body, 4, str(tmp_path), timeout=120)
    for tracker_fresh, default_untouched in run_distributed(tp_load_body, 4, str(tmp_path), timeout=120):
        assert tracker_fresh and default_untouched
