"""qwZ and stage 3's persistent parameters (those under `stage3_param_persistence_threshold`), as
DeepSpeed does: they are gathered once after each step, unquantized (DeepSpeed's `_post_step`
gathers them with `all_gather`, which quantizes only parameters stored quantized at rest, i.e.
frozen ones under `zero_quantized_nontrainable_weights`, never by `zero_quantized_weights`). So with
every parameter persistent, qwZ changes no number."""

from __future__ import annotations

import torch

from tests.engine_helpers import train_distributed
from tests.harness import distributed_test
from tests.zero.test_mics import _traced_step, config


def persistent(**zero) -> dict:
    return config(stage3_param_persistence_threshold=10**9, **zero)


@distributed_test(world_size=2)
def test_qwz_leaves_persistent_parameters_unquantized():
    t, _, engine = _traced_step(persistent(zero_quantized_weights=True))
    assert engine.groups and not any(g.policy.shard_parameters for g in engine.groups)  # every group persistent
    gathers = [r for r in t.records if r.op == "all_gather" and r.numel > 64]
    assert gathers and all(r.dtype == torch.float32 for r in gathers)  # the after-step gather, not int8
    torch.manual_seed(0)
    _, plain = train_distributed(persistent(), 3)
    torch.manual_seed(0)
    _, quantized = train_distributed(persistent(zero_quantized_weights=True), 3)
    for key in plain:
        assert torch.equal(plain[key], quantized[key]), key
