"""Every technique applied to a part returns a part state with one surface (zerodist/comm/parts.py):
to_logical / from_logical / report / remove_hooks. Checked on tensor 2 at ZeRO 3 (4 ranks: data 2
x tensor 2): the logical state has the plain model's keys and shapes and its values, and
from_logical gives back exactly what each rank holds."""

from __future__ import annotations

import torch

import zerodist
from tests.harness import run_distributed
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.moe.parallel import ExpertParallelState
from zerodist.sequence.apply import SequenceParallelState
from zerodist.tensor_parallel.apply import TensorParallelState
from zerodist.zero import GatheredParameters, ZeroState

SHAPE = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def body() -> list[str]:
    torch.manual_seed(0)
    plain = GPT(SHAPE).state_dict()
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=GPT(SHAPE), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}})
    parts = engine.part_states  # by name, in the order applied
    assert list(parts) == ["tensor", "sequence", "expert", "zero"]
    tensor, sequence, experts, zero = (parts[name] for name in parts)
    assert isinstance(tensor, TensorParallelState) and isinstance(experts, ExpertParallelState)
    assert isinstance(sequence, SequenceParallelState) and sequence.report() == []  # sequence degree 1
    assert isinstance(zero, ZeroState) and zero.runtime is engine.units
    logical = engine.module_state_dict()
    assert logical.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(logical[key], value), key  # the same init, the same values
    with GatheredParameters(list(engine.module.parameters())):
        held = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    back = tensor.from_logical(sequence.from_logical(experts.from_logical(logical)))
    assert back.keys() == held.keys()
    for key in held:
        assert torch.equal(back[key], held[key]), key
        assert torch.equal(parts.from_logical(logical)[key], held[key]), key  # the container's loop, in reverse
    reports = parts.report()
    assert reports == tensor.report() + experts.report() + zero.report()
    engine.destroy()
    return reports


def test_part_states_map_to_and_from_the_logical_model():
    reports = run_distributed(body, 4, timeout=120)[0]
    assert reports[0].startswith("tensor parallel: degree 2") and reports[1].startswith("ZeRO stage 3")
