"""One checkpoint, with and without pipelining: a model split by `split_model` keeps its own names
([Note: split keeps the names] in zerodist/pipe/split.py), so zerodist's checkpoint saved at pipe 2
loads into the unsplit model (no pipeline) and the other way round, the optimizer state with it;
`consolidate` writes the model's own keys, which `from_pretrained` of a Hugging Face model takes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zerodist
from tests.harness import run_distributed
from tests.pipe.test_split import GAS, build, config, logits_of, micro_batch, reference_body
from zerodist.pipe import split_model, token_cross_entropy

def split_body(family: str, path: str, load: bool, first_step: int, steps: int, save: bool):
    module = split_model(build(family), num_stages=2)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1))
    if load:
        engine.load_checkpoint(path)
    for step in range(first_step, first_step + steps):
        engine.train_batch(iter([micro_batch(step, micro, 0) for micro in range(GAS)]))
    if save:
        engine.save_checkpoint(path)
    state, done = engine.module_state_dict(), engine.global_steps
    engine.destroy()
    return state, done


def unsplit_body(family: str, path: str, load: bool, first_step: int, steps: int, save: bool):
    """The user's model as written, no pipeline: DeepSpeed's forward / backward / step per micro-batch."""
    engine, _, _, _ = zerodist.initialize(model=build(family), config=config(1))
    if load:
        engine.load_checkpoint(path)
    for step in range(first_step, first_step + steps):
        for micro in range(GAS):
            x, y = micro_batch(step, micro, 0)
            loss = token_cross_entropy(logits_of(engine, x), y)
            engine.backward(loss)
            engine.step()
    if save:
        engine.save_checkpoint(path)
    state, done = engine.module_state_dict(), engine.global_steps
    engine.destroy()
    return state, done


def assert_matches(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        assert torch.allclose(value, expected[key], rtol=0, atol=1e-6), key


# Llama: separate q/k/v and gate/up, untied. GPT-2: lm_head is wte, which both stages hold and train under its
# first name, transformer.wte.weight, as the unsplit model does ([Note: tied parameters keep their first name]).
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_split_load_unsplit_and_back(tmp_path, family):
    (_, uninterrupted), = run_distributed(reference_body, 1, family, 1, 0, 4)  # four steps, one process
    split_dir, unsplit_dir = str(tmp_path / "split"), str(tmp_path / "unsplit")

    # pipe 2 -> no pipeline: two steps split, two more unsplit, equal four uninterrupted ones
    run_distributed(split_body, 2, family, split_dir, False, 0, 2, True)
    (state, done), = run_distributed(unsplit_body, 1, family, split_dir, True, 2, 2, False)
    assert done == 4 and set(state) == set(uninterrupted[-1])
    assert_matches(state, uninterrupted[-1])

    # no pipeline -> pipe 2: two steps unsplit, two more split
    run_distributed(unsplit_body, 1, family, unsplit_dir, False, 0, 2, True)
    results = run_distributed(split_body, 2, family, unsplit_dir, True, 2, 2, False)
    assert {key for state, _ in results for key in state} == set(uninterrupted[-1])
    for state, done in results:
        assert done == 4
        assert_matches(state, uninterrupted[-1])

    # consolidate: the model's own keys, which Hugging Face's from_pretrained takes as they are
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    subprocess.run([sys.executable, "-m", "zerodist", "checkpoint", "consolidate", split_dir,
                    str(hf_dir / "model.safetensors")], check=True, capture_output=True)
    model = build(family)
    model.config.save_pretrained(hf_dir)
    model.save_pretrained(tmp_path / "hf-own")  # what Hugging Face itself writes for this model
    from safetensors import safe_open

    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (hf_dir, tmp_path / "hf-own")]
    assert keys[0] == set(model.state_dict())  # GPT-2's save_pretrained leaves the tied lm_head.weight out
    assert keys[1] == keys[0] - ({"lm_head.weight"} if family == "gpt2" else set())
    loaded = type(model).from_pretrained(hf_dir)
    (_, after_two), = run_distributed(reference_body, 1, family, 1, 0, 2)
    assert_matches(loaded.state_dict(), after_two[-1])

