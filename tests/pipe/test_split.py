"""`split_model`: a model the user already wrote (the demo GPT, Hugging Face Llama and GPT-2) cut into
pipeline stages that keep its own parameter names, trained through the pipeline engine on gloo
ranks against the unsplit model in one process doing gradient accumulation over the same
micro-batches ([Note: split keeps the names] in zerodist/pipe/split.py)."""

from __future__ import annotations

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from zerodist.pipe import split_model, token_cross_entropy

VOCAB, SEQ, MICRO, GAS, STEPS, LR = 64, 8, 2, 4, 5, 0.1


def build(family: str) -> torch.nn.Module:
    """A tiny model of `family`, the same on every rank (seeded)."""
    torch.manual_seed(0)
    if family in ("gpt", "gpt-deep", "gpt-untied"):
        from zerodist.models import GPTConfig
        from zerodist.models.gpt import GPT

        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=4 if family == "gpt-deep" else 2,
                             n_heads=2, tie_embeddings=family != "gpt-untied"))
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny vocabulary's warning about GPT-2's token ids
    if family in ("llama", "llama-kv2"):  # separate q/k/v, gate/up, untied head; grouped-query attention
        # (llama-kv2: 4 query heads over 2 key/value heads, which tensor degree 2 splits)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2 if family == "llama" else 4, num_key_value_heads=1 if family == "llama" else 2,
            max_position_embeddings=SEQ, tie_word_embeddings=False))
    if family == "gpt2":  # Conv1D, the head tied to wte
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    raise ValueError(family)


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    return output if isinstance(output, torch.Tensor) else output.logits


def micro_batch(step: int, micro: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_body(family: str, data: int, first_step: int = 0, steps: int = STEPS,
                   start: dict[str, torch.Tensor] | None = None):
    """One process, the unsplit model: gradient accumulation over every data rank's micro-batches,
    torch's SGD with momentum; the state dict after each step."""
    model = build(family)
    if start is not None:
        model.load_state_dict(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, states = [], []
    for step in range(first_step, first_step + steps):
        total = 0.0
        for micro in range(GAS):
            parts = [micro_batch(step, micro, d) for d in range(data)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = token_cross_entropy(logits_of(model, x), y)
            (loss / GAS).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses, states


def reference_eval(family: str, data: int) -> float:
    """The unsplit model after `reference_body`'s steps: its mean loss over evaluation micro-batches."""
    _, states = reference_body(family, data)
    model = build(family)
    model.load_state_dict(states[-1])
    model.eval()
    with torch.no_grad():
        losses = [token_cross_entropy(logits_of(model, torch.cat([eval_batch(m, d)[0] for d in range(data)])),
                                      torch.cat([eval_batch(m, d)[1] for d in range(data)])).item()
                  for m in range(GAS)]
    return sum(losses) / GAS


def eval_batch(micro: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return micro_batch(99, micro, data_rank)


def config(stage: int, schedule: str = "1f1b", stages_per_rank: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}, "zero_optimization": {"stage": stage},
            "zerodist": {"pipeline": {"schedule": schedule, "stages_per_rank": stages_per_rank}}}


def pipeline_body(family: str, stage: int, schedule: str = "1f1b", split_points: list[str] | None = None,
                  stages_per_rank: int = 1):
    model = build(family)
    module = split_model(model, num_stages=2, split_points=split_points, stages_per_rank=stages_per_rank)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(stage, schedule, stages_per_rank))
    data_rank = engine.topology.axis_rank("data")
    losses, states = [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter([micro_batch(step, m, data_rank) for m in range(GAS)])).item())
        states.append(engine.module_state_dict())
    keys = list(module.state_dict())
    evaluated = engine.eval_batch(iter([eval_batch(m, data_rank) for m in range(GAS)])).item()
    engine.destroy()
    return losses, states, keys, module.layer_names[module.parts[1]], sorted(module.tied_keys), module.parts, evaluated


def check(family: str, world: int, stage: int, **options) -> list:
    (ref_losses, ref_states), = run_distributed(reference_body, 1, family, world // 2)
    results = run_distributed(pipeline_body, world, family, stage, **options)
    keys: set[str] = set()
    for losses, states, own_keys, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-6)  # the same loss on every rank, the reference's
        keys |= set(own_keys)
        for step, state in enumerate(states):
            assert set(state) == set(own_keys)
            for key, value in state.items():
                assert torch.allclose(value, ref_states[step][key], rtol=0, atol=1e-6), (family, step, key)
    assert keys == set(ref_states[0])  # the union over stages is the unsplit model's own keys
    return results


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 3)])
def test_demo_gpt_split_in_two_with_tied_head(world, stage):
    results = check("gpt", world, stage)
    assert results[0][3] == "blocks.1"  # balanced: embedding + a block | a block + norm + head
    assert results[0][4] == ["tok_emb.weight"]  # lm_head.weight is it: a tied layer across the two stages
    assert "tok_emb.weight" in results[0][2] and "lm_head.weight" in results[-1][2]
    assert "lm_head.weight" not in results[0][2] and "blocks.0.attn.qkv.weight" not in results[-1][2]


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 3)])
def test_hf_llama_split_in_two(world, stage):
    results = check("llama", world, stage, split_points=["model.layers.1"])
    assert "model.layers.1.self_attn.q_proj.weight" in results[-1][2]
    assert "model.embed_tokens.weight" in results[0][2] and results[0][4] == []


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 3)])
def test_hf_gpt2_split_in_two_with_tied_wte(world, stage):
    results = check("gpt2", world, stage)
    (expected,) = run_distributed(reference_eval, 1, "gpt2", world // 2)
    assert [r[6] for r in results] == pytest.approx([expected] * world, rel=1e-6)  # eval_batch, every rank
    assert results[0][4] == ["transformer.wte.weight"]
    assert "transformer.h.0.attn.c_attn.weight" in results[0][2] and "lm_head.weight" in results[-1][2]
    assert "transformer.wte.weight" in results[-1][2]  # the tied weight under its first name on both stages


def test_zero_bubble_runs_the_weight_gradients_of_the_model_own_modules():
    # ZB-H1's W action takes the stage's parameters from `stage_modules`, not from layer indices
    check("llama", 2, 1, schedule="zb")


def test_interleaved_two_stages_per_rank_with_the_tie_across_ranks():
    # 4 stages on 2 ranks (rank 0: stages 0 and 2); the tied embedding/head on stages 0 and 3
    results = check("gpt-deep", 2, 1, schedule="interleaved", stages_per_rank=2)
    assert results[0][5] == [0, 1, 2, 4, 7] and results[0][4] == ["tok_emb.weight"]
