"""Domino inside a pipeline ([Note: Domino per stage] in zerodist/tensor_parallel/apply.py): a model
cut by `split_model`, each stage tensor-parallel with its blocks run by Domino's schedule (the
chunks' all-reduces overlapped within a block and, under inter-layer overlap, between the blocks of
a stage; each stage's last block joins its chunks, so the stages pass tensors). pipe 2 x tensor 2 on
4 gloo ranks, 5 SGD steps: parameters within 1e-6 of the unsplit model in one process doing
gradient accumulation over the same micro-batches."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.compose.parity import assert_states_match
from tests.harness import run_distributed
from tests.hf_models import small_hf_model
from tests.pipe.test_split import GAS, LR, SEQ, STEPS, VOCAB, config, logits_of, micro_batch
from zerodist.pipe import split_model, token_cross_entropy

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def build(family: str) -> torch.nn.Module:
    """Four blocks, so that a stage of a 2-stage pipeline chains two Domino blocks (inter-layer)."""
    torch.manual_seed(0)
    if family == "gpt":
        from zerodist.models import GPTConfig
        from zerodist.models.gpt import GPT

        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=4, n_heads=2, tie_embeddings=False))
    return small_hf_model(family, layers=4, vocab=VOCAB, seq=SEQ)


def reference_body(family: str) -> list[dict[str, torch.Tensor]]:
    """One process, the unsplit model, gradient accumulation over the micro-batches, SGD + momentum."""
    model = build(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    states = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = micro_batch(step, micro, 0)
            (token_cross_entropy(logits_of(model, x), y) / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def domino_pipe_body(family: str, stage: int, overlap: str, stages_per_rank: int):
    module = split_model(build(family), num_stages=2, stages_per_rank=stages_per_rank)
    settings = config(stage, "interleaved" if stages_per_rank > 1 else "1f1b", stages_per_rank)
    settings["tensor_parallel"] = {"autotp_size": 2}
    settings["zerodist"]["tensor_parallel"] = {"domino": {"chunks": 2, "overlap": overlap}}
    if stage == 3:  # each block released right after its forward, so a read after release shows
        settings["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                                             stage3_prefetch_bucket_size=0)
    engine, _, _, _ = zerodist.initialize(model=module, config=settings)
    kinds = sorted({type(m).__name__ for m in engine.module.modules() if "Domino" in type(m).__name__})
    states = []
    for step in range(STEPS):
        engine.train_batch(iter([micro_batch(step, m, 0) for m in range(GAS)]))
        states.append(engine.module_state_dict())
    engine.destroy()
    return states, kinds


@pytest.mark.parametrize("family, stage, overlap, stages_per_rank", [
    ("gpt", 1, "inter", 1), ("gpt", 3, "inter", 1), ("gpt", 3, "inter", 2), ("llama", 1, "inter", 1),
    ("gpt2", 1, "intra", 1)])
def test_pipe2_tensor2_domino_equals_one_process(family, stage, overlap, stages_per_rank):
    ref_states, = run_distributed(reference_body, 1, family)
    results = run_distributed(domino_pipe_body, 4, family, stage, overlap, stages_per_rank, timeout=300)
    assert_states_match([states for states, _ in results], ref_states, (family, stage, overlap))
    for _, kinds in results:
        assert kinds, "no block runs Domino's schedule"
