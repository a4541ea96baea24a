"""TRL at ZeRO-3 through the switch: TRL's `maybe_gather_lm_head_ctx` reads DeepSpeed's per-parameter `ds_status`;
zerodist sets no attribute on parameters, so the served import of `trl.trainer.utils` replaces that one function
with the same rule asked of zerodist's side table ([Note: TRL's lm-head gather under the served ZeRO-3])."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from zerodist.integrations import trl_zero3

REPO = Path(__file__).resolve().parents[2]


def _trl_like_module() -> types.ModuleType:
    module = types.ModuleType("fake_trl_utils")

    def maybe_gather_lm_head_ctx(*params):  # TRL's rule, by DeepSpeed's attribute
        return [p.ds_status for p in params]

    module.maybe_gather_lm_head_ctx = maybe_gather_lm_head_ctx  # type: ignore[attr-defined]
    return module


@pytest.mark.unit
def test_the_replacement_asks_the_side_table_not_the_parameter(monkeypatch):
    import transformers.integrations.deepspeed as hf_deepspeed

    module = _trl_like_module()
    trl_zero3.replace_lm_head_gather(module)
    trl_zero3.replace_lm_head_gather(module)  # once only
    weight = torch.nn.Parameter(torch.ones(2, 2))
    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    # A parameter no engine shards: nothing to gather, and no attribute read (TRL's would raise here).
    assert isinstance(module.maybe_gather_lm_head_ctx(weight, None), contextlib.nullcontext)
    assert not hasattr(weight, "ds_status")
    # One the side table says is sharded now: gathered, once even when passed twice (tied weights).
    monkeypatch.setattr("zerodist.zero.registry.is_sharded", lambda p: p is weight)
    gather = module.maybe_gather_lm_head_ctx(weight, weight, None)
    assert type(gather).__name__ == "GatheredParameters" and list(gather.params) == [weight]
    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: False)
    assert isinstance(module.maybe_gather_lm_head_ctx(weight), contextlib.nullcontext)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
def test_served_trl_gets_the_replacement():
    from zerodist.integrations.as_deepspeed import environment

    code = textwrap.dedent("""
        import torch
        from trl.trainer import utils
        assert getattr(utils.maybe_gather_lm_head_ctx, "_zerodist_side_table", False)
        from trl.models import utils as model_utils
        assert all(getattr(getattr(model_utils, name), "_zerodist_side_table", False)
                   for name in ("remove_hooks", "add_hooks"))
        print("ok")
    """)
    env = environment({**os.environ, "PYTHONPATH": str(REPO)})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
