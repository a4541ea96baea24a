"""The layout-invariant mode with a pipeline (issue 35, docs/determinism.md): the demo GPT as pipeline
layers, its token embedding tied across the first and last stage, pipe 2 under 1F1B, GPipe,
interleaved and ZB-H1, AdamW with clipping active: parameters, AdamW state and per-step losses
torch.equal to one process x 8 micro-batches (a plain engine, no pipeline), 10 steps; a Hugging Face
Llama cut by split_model at pipe 2 x data 2 x 4; a checkpoint from pipe 1 x data 4 resumed at pipe 2
x data 2 for 10 steps.
[Note: pipeline gradients by micro-batch] in zerodist/engine/pipeline_invariant.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import run_distributed
from tests.zero.layout_invariant_helpers import logical_optimizer_state
from zerodist.models import GPTConfig
from zerodist.models.gpt_pipe import gpt_loss, gpt_pipeline_layers
from zerodist.pipe import PipelineModule, split_model, token_cross_entropy
from zerodist.zero.canonical import micro_batch_index

CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=3, n_heads=2)
MICROS, ROWS, STEPS = 8, 2, 10
HEAD = CONFIG.n_layers + 2  # the head's layer index: its tied copy of the embeddings
LLAMA_VOCAB = 96  # tests/hf_models.py's tiny Llama (eager attention), on CONFIG.seq_len tokens


def layers(stages: int, per_rank: int = 1) -> PipelineModule:
    return PipelineModule(gpt_pipeline_layers(CONFIG), num_stages=stages, loss_fn=gpt_loss, seed_layers=True,
                          partition_method="uniform", stages_per_rank=per_rank)


def llama() -> torch.nn.Module:
    from tests.hf_models import hf_class, hf_config

    torch.manual_seed(0)
    return hf_class("llama")(hf_config("llama"))


def staged(kind: str, stages: int, per_rank: int = 1) -> torch.nn.Module:
    """This rank's pipeline module: the demo GPT's layers, or the Llama cut by split_model (its own names)."""
    if kind == "llama":
        return split_model(llama(), num_stages=stages, stages_per_rank=per_rank)
    return layers(stages, per_rank)


class Whole(torch.nn.Module):
    """The same model in one module (the GPT's tied embedding used twice), returning the loss."""

    def __init__(self, kind: str = "gpt") -> None:
        super().__init__()
        self.kind = kind
        self.layers = llama() if kind == "llama" else layers(1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return token_cross_entropy(self.layers(x).logits, y)
        return gpt_loss(self.layers(x), y)


def config(stage: int, accumulation: int, extra: dict[str, Any] | None = None, **zerodist_keys: Any) -> dict[str, Any]:
    return (extra or {}) | {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "gradient_clipping": 0.1, "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096},
            "zerodist": {"deterministic": "layout_invariant", **zerodist_keys}, "steps_per_print": 10**9}


def micro_batch(step: int, k: int, kind: str = "gpt") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    vocab = LLAMA_VOCAB if kind == "llama" else CONFIG.vocab_size
    tokens = torch.randint(0, vocab, (MICROS * ROWS, CONFIG.seq_len + 1), generator=g)
    rows = tokens[k * ROWS: (k + 1) * ROWS]
    return rows[:, :-1], rows[:, 1:]


def _result(engine: Any, losses: list[torch.Tensor], clipped: int, prefix: str = "") -> dict[str, Any]:
    strip = (lambda k: k[len(prefix):] if k.startswith(prefix) else k)
    result = {"params": {strip(k): v for k, v in engine.module_state_dict().items()},
              "optimizer": {strip(k): v for k, v in logical_optimizer_state(engine).items()},
              "losses": torch.stack(losses), "clipped_steps": clipped}
    engine.destroy()
    return result


def one_process(kind: str = "gpt", steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = zerodist.initialize(model=Whole(kind), config=config(0, MICROS, extra))[0]
    losses, clipped = [], 0
    for step in range(steps):
        losses.append(engine.train_batch(iter([micro_batch(step, k, kind) for k in range(MICROS)])))
        clipped += engine.last_step.clip_coef < 1.0
    return _result(engine, losses, clipped, prefix="layers.")


def pipelined(stage: int, schedule: str, pipe: int = 2, first_step: int = 0, steps: int = STEPS,
              load: str | None = None, save: str | None = None, kind: str = "gpt", **extra: Any) -> dict[str, Any]:
    """`steps` steps from global batch `first_step` on pipe `pipe` x data (world / pipe), accumulation
    MICROS / data (after loading the checkpoint in `load`; then saving one in `save`)."""
    torch.manual_seed(0)
    per_rank = 2 if schedule == "interleaved" else 1
    data = comm.get_world_size() // pipe
    accumulation = MICROS // data
    model = staged(kind, pipe, per_rank)
    engine = zerodist.initialize(model=model, config=config(stage, accumulation, extra,
                                                                  pipeline={"schedule": schedule}))[0]
    if load is not None:
        engine.load_checkpoint(load)
    rank = engine.topology.axis_rank("data")
    losses, clipped = [], 0
    for step in range(first_step, first_step + steps):
        mine = [micro_batch(step, micro_batch_index(rank, j, data, accumulation, shard_gradients=False), kind)
                for j in range(accumulation)]
        losses.append(engine.train_batch(iter(mine)))
        clipped += engine.last_step.clip_coef < 1.0
    if save is not None:
        engine.save_checkpoint(save)
    return _result(engine, losses, clipped)


BF16 = {"bf16": {"enabled": True}}


@functools.cache
def reference(kind: str = "gpt", steps: int = STEPS, bf16: bool = False) -> dict[str, Any]:
    result = run_distributed(one_process, 1, kind, steps, timeout=240, **(BF16 if bf16 else {}))[0]
    assert result["clipped_steps"] > 0, "the test needs gradient clipping active"
    return result


def assert_bitwise(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["params"].keys() <= expected["params"].keys()  # a stage's own (module_state_dict)
    differing = [k for k, v in actual["params"].items() if not torch.equal(v, expected["params"][k])]
    assert not differing, f"params: {len(differing)} differ, e.g. {differing[:3]}"
    # a stage's optimizer holds its own parameters; the head's tied copy is the embedding's one process
    for key, value in actual["optimizer"].items():
        if key == "steps":
            assert torch.equal(value, expected["optimizer"][key])
            continue
        reference_key = key if key in expected["optimizer"] else key.replace(f"{HEAD}.tok_emb", "0.tok_emb", 1)
        assert torch.equal(value, expected["optimizer"][reference_key]), key
    assert torch.equal(actual["losses"], expected["losses"]), (actual["losses"], expected["losses"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb", pytest.param("gpipe", marks=pytest.mark.slow),
                                      pytest.param("interleaved", marks=pytest.mark.slow)])
def test_pipe_2_by_8_micro_batches_is_bitwise_one_process(schedule):
    results = run_distributed(pipelined, 2, 1, schedule, timeout=240)
    for result in results:
        assert_bitwise(result, reference())
    assert set().union(*(r["params"] for r in results)) == reference()["params"].keys()


@pytest.mark.slow
@pytest.mark.parametrize("stage,schedule", [(1, "1f1b"), (1, "zb"), (1, "interleaved"), (3, "1f1b")])
def test_pipe_2_by_data_2_by_accumulation_4_is_bitwise_one_process(stage, schedule):
    results = run_distributed(pipelined, 4, stage, schedule, timeout=300)
    for result in results:
        assert_bitwise(result, reference())
    assert set().union(*(r["params"] for r in results)) == reference()["params"].keys()


@pytest.mark.slow
def test_bf16_at_pipe_2_by_data_2_by_accumulation_4_is_bitwise_one_process():
    """bf16 parameters, activations and gradients (the tree's adds in bf16), fp32 master and AdamW state."""
    results = run_distributed(pipelined, 4, 1, "1f1b", timeout=300, **BF16)
    for result in results:
        assert_bitwise(result, reference(bf16=True))
    assert not torch.equal(reference(bf16=True)["losses"], reference()["losses"])  # bf16 did take effect


@pytest.mark.slow
def test_hugging_face_llama_at_pipe_2_by_data_2_by_accumulation_4_is_bitwise_one_process():
    """The tiny HF Llama (tests/hf_models.py) cut by split_model, ZeRO 1, 1F1B, against the whole
    Llama in one plain engine x 8 micro-batches."""
    results = run_distributed(pipelined, 4, 1, "1f1b", kind="llama", timeout=300)
    expected = reference("llama")
    for result in results:
        assert_bitwise(result, expected)
    assert set().union(*(r["params"] for r in results)) == expected["params"].keys()


@pytest.mark.slow
def test_a_checkpoint_at_data_4_resumes_at_pipe_2_by_data_2_bitwise(tmp_path):
    """Saved by the same layers at pipe 1 x data 4 (accumulation 2, ZeRO 3) after 5 steps, resumed at
    pipe 2 x data 2 (accumulation 4, ZeRO 1, 1F1B): the next 10 steps (parameters, AdamW state and
    losses) equal the uninterrupted one-process run of 15 steps."""
    before, after = 5, STEPS
    expected = reference("gpt", before + after)
    for result in run_distributed(pipelined, 4, 3, "1f1b", 1, 0, before, None, str(tmp_path), timeout=300):
        assert torch.equal(result["losses"], expected["losses"][:before])
    results = run_distributed(pipelined, 4, 1, "1f1b", 2, before, after, str(tmp_path), timeout=300)
    for result in results:
        assert_bitwise({**result, "losses": torch.cat([expected["losses"][:before], result["losses"]])}, expected)
    assert set().union(*(r["params"] for r in results)) == expected["params"].keys()
