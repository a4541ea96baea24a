"""The flattening plan: pure, one process, no tensors' values ([Note: one plan for every stage])."""

from __future__ import annotations

import pytest

from zerodist.models import GPT, gpt_config, make_mlp
from zerodist.zero import Init
from zerodist.zero.plan import bucket_capacity, plan_groups

pytestmark = pytest.mark.unit


def _names(model, plan):
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [(g.unit, g.spec, [name_of[id(p)] for p in g.params]) for g in plan.groups]


def test_units_root_first_then_persistent_groups():
    model = GPT(gpt_config("tiny", n_layers=2))
    plan = plan_groups(model, [list(model.parameters())], unit_classes=[], persistence_threshold=1000,
                       bucket_numel=10**9)
    assert [name for name, _ in plan.unit_modules] == ["blocks.0", "blocks.1"]
    groups = _names(model, plan)
    assert [(unit, spec) for unit, spec, _ in groups] == [(0, 0), (1, 0), (2, 0), (None, 0)]
    assert groups[0][2] == ["tok_emb.weight", "pos_emb.weight", "lm_head.weight"]
    assert all(n.startswith("blocks.1.") and n.endswith("weight") for n in groups[2][2])
    small = groups[3][2]
    assert "blocks.0.ln_1.weight" in small and "ln_f.bias" in small
    # every trained parameter exactly once, each group in model.parameters() order
    order = [n for n, _ in model.named_parameters()]
    assert sorted(n for *_, names in groups for n in names) == sorted(order)
    for *_, names in groups:
        assert names == sorted(names, key=order.index)


def test_each_unit_splits_by_optimizer_param_group_and_skips_frozen_parameters():
    model = make_mlp()
    model[4].bias.requires_grad_(False)
    decay = [model[0].weight, model[2].weight, model[4].weight]
    no_decay = [model[0].bias, model[2].bias]
    plan = plan_groups(model, [decay, no_decay], unit_classes=["Linear"], persistence_threshold=40,
                       bucket_numel=10**9)
    assert [(g.unit, g.spec, len(g.params)) for g in plan.groups] == [
        (1, 0, 1), (2, 0, 1), (3, 0, 1), (None, 1, 2)]  # the biases (32 and 35 elements) are persistent
    assert plan.unit_groups(2) == [1] and plan.unit_groups(0) == []
    assert plan.by_spec(2, "abcd") == [["a", "b", "c"], ["d"]]


def test_a_model_built_on_the_meta_device_plans_the_same():
    eager = GPT(gpt_config("tiny"))
    with Init():
        lazy = GPT(gpt_config("tiny"))
    shapes = [[[tuple(p.shape) for p in g.params] for g in plan_groups(
        m, [list(m.parameters())], unit_classes=[], persistence_threshold=2000, bucket_numel=1).groups]
        for m in (eager, lazy)]
    assert shapes[0] == shapes[1] and len(shapes[0]) == 4


def test_one_bucket_capacity_for_every_stage():
    assert bucket_capacity(500, 700) == bucket_capacity(700, 500) == 500
    assert bucket_capacity(0, 10) == 1
