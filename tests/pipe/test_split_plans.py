"""`split_model` without processes: bad split points and plans are named errors raised before any
process-group work (no process group exists here, and none is needed to refuse them), and a
user-written plan splits a model no built-in plan knows, keeping its names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerodist.models import GPTConfig
from zerodist.models.gpt import GPT
from zerodist.pipe import SplitError, SplitPlan, UnknownModelError, split_model
from zerodist.pipe.split_plans import GPT_SPLIT_PLAN

pytestmark = pytest.mark.unit


def gpt(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=layers, n_heads=2))


def test_unknown_split_point_is_named():
    with pytest.raises(SplitError, match=r"split point 'blocks\.9' is not a layer of this model.*blocks\.0"):
        split_model(gpt(), num_stages=2, split_points=["blocks.9"])


@pytest.mark.parametrize("points,empty", [(["tok_emb"], 0), (["blocks.2", "blocks.1"], 1), (["blocks.1", "blocks.1"], 1)])
def test_a_cut_that_leaves_a_stage_empty_is_named(points, empty):
    with pytest.raises(SplitError, match=rf"leave stage {empty} empty"):
        split_model(gpt(), num_stages=len(points) + 1, split_points=points)


def test_more_stages_than_blocks_is_named():
    with pytest.raises(SplitError, match="5 pipeline stages for 4 blocks: more stages than blocks"):
        split_model(gpt(), num_stages=5)


def test_split_point_count_must_match_the_stages():
    with pytest.raises(SplitError, match=r"1 split point\(s\) .* make 2 stages, but the pipeline has 3"):
        split_model(gpt(), num_stages=3, split_points=["blocks.2"])


def test_unknown_model_says_how_to_give_a_plan():
    with pytest.raises(UnknownModelError, match=r"no plan for Sequential .*plan=zerodist\.pipe\.SplitPlan\("):
        split_model(nn.Sequential(nn.Linear(2, 2)), num_stages=1)


def test_a_plan_naming_a_missing_module_is_named():
    plan = SplitPlan(embed=("tok_emb",), blocks="layers", norm="ln_f", head="lm_head")
    with pytest.raises(SplitError, match=r"names the blocks 'layers', which GPT does not have"):
        split_model(gpt(), num_stages=1, plan=plan)


def test_a_plan_that_leaves_state_out_is_named():
    plan = SplitPlan(embed=("tok_emb",), blocks="blocks", norm="ln_f", head="lm_head")  # pos_emb left out
    with pytest.raises(SplitError, match=r"leaves out 1 state-dict entries of GPT \(e\.g\. pos_emb\.weight\)"):
        split_model(gpt(), num_stages=1, plan=plan)


def test_a_shared_module_with_parameters_is_refused():
    plan = SplitPlan(embed=("tok_emb", "pos_emb", "emb_dropout"), blocks="blocks", norm="ln_f", head="lm_head",
                     shared=("ln_f",))
    with pytest.raises(SplitError, match=r"names \['ln_f'\] more than once"):
        split_model(gpt(), num_stages=1, plan=plan)
    plan = SplitPlan(embed=("tok_emb", "pos_emb", "emb_dropout"), blocks="blocks", norm=None, head="lm_head",
                     shared=("ln_f",))
    with pytest.raises(SplitError, match="shared module 'ln_f' has parameters"):
        split_model(gpt(), num_stages=1, plan=plan)


class Tagger(nn.Module):
    """A model no built-in plan knows: embed -> blocks -> norm -> head, under its own names."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"words": nn.Embedding(32, 8)})
        self.stack = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.final = nn.LayerNorm(8)
        self.out = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.encoder["words"](ids)
        for block in self.stack:
            x = x + block(x)
        return self.out(self.final(x))


def test_a_user_plan_splits_an_unknown_model_keeping_its_names():
    torch.manual_seed(0)
    model = Tagger()
    plan = SplitPlan(embed="encoder.words", blocks="stack", norm="final", head="out",
                     block_fn=lambda model, block, x: x + block(x))
    module = split_model(model, num_stages=1, plan=plan, loss_fn=nn.functional.cross_entropy)
    assert list(module.state_dict()) == list(model.state_dict())
    assert module.layer_names == ["encoder.words", "stack.0", "stack.1", "stack.2", "final", "out"]
    ids = torch.randint(0, 32, (2, 6))
    assert torch.equal(module(ids), model(ids))


def _snapshot(model: nn.Module) -> dict:
    """Every module's own attributes, the dicts among them (children, parameters, buffers, hooks)
    copied, so that an entry added to one after the snapshot shows as a difference."""
    return {name: {key: (dict(value) if isinstance(value, dict) else value) for key, value in vars(module).items()}
            for name, module in model.named_modules()}


def test_the_user_model_is_left_as_it_was():
    model = gpt()
    before, keys = _snapshot(model), list(model.state_dict())
    split_model(model, num_stages=1)
    assert _snapshot(model) == before and list(model.state_dict()) == keys


def test_the_builtin_gpt_plan_is_found_by_class_path():
    assert split_model(gpt(), num_stages=1).plan is GPT_SPLIT_PLAN


def test_activation_checkpointing_gives_the_same_gradients():
    model = gpt()
    ids = torch.randint(0, 32, (2, 8))
    grads = []
    for interval in (0, 1):
        model.zero_grad()
        split_model(model, num_stages=1, activation_checkpoint_interval=interval)(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(*grads))
