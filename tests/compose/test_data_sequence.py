"""Issue 31's pair data x sequence with its bytes per axis (tests/sequence/test_engine.py checks its
parameters only): data 2 x sequence 2 on 4 gloo ranks, a tiny Hugging Face Llama (4 query over 2
key/value heads), Ulysses, ZeRO 1 and 3, SGD: parameters within 1e-6 of one process on the whole
sequences of the same global batch; per micro-batch Ulysses' all-to-alls of every attention layer
(`ulysses_bytes`, forward and backward alike), and ZeRO's reduce-scatters and all-gathers over
data x sequence (4 ranks) equal to docs/design/zero.md's formula (from the second step on: at
stage 3 the first step gathers what later steps prefetched in the step before)."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import distributed_test
from tests.sequence.test_engine import MICRO, SEQ, STEPS, _build, _config, _reference, _samples, _sliced_batch
from zerodist.sequence import SequenceLayout
from zerodist.sequence.layout import ulysses_bytes
from zerodist.train.report import expected_bus_bytes

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2  # tests/hf_models.py's Llama


@pytest.mark.parametrize("stage", [1, 3])
@distributed_test(world_size=4, timeout=240)
def test_data2_sequence2_llama_bytes_per_axis(stage, world_size):
    data = world_size // 2
    settings = _config(stage, data)
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine = zerodist.initialize(model=_build("llama"), config=settings)[0]
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2, "expert": 1, "sequence": 2, "tensor": 1}
    layout = SequenceLayout(engine.topology.axis_rank("sequence"), 2)
    shard, psi = engine.topology.batch_rank, sum(g.layout.total_numel for g in engine.groups)
    one = LAYERS * ulysses_bytes(batch=MICRO, seq=SEQ, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, degree=2,
                                 element_size=4)
    zero = expected_bus_bytes(stage=stage, psi=psi, world_size=4, accumulation_steps=1, reduce_scatter=True,
                              element_bytes=4)
    for step in range(STEPS):
        ids, labels = _samples(step, MICRO * data)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        with comm.trace() as forward:
            loss = engine(**_sliced_batch("llama", ids[rows], labels[rows], layout)).loss
        with comm.trace() as backward:
            engine.backward(loss)
        with comm.trace() as stepped:
            engine.step()
        assert (forward.bus_bytes("all_to_all"), backward.bus_bytes("all_to_all")) == (one, one)
        sharded = sum(r.bus_bytes for t in (forward, backward, stepped) for r in t.records
                      if r.op in ("reduce_scatter", "all_gather") and r.group_size == 4
                      and r.dtype == torch.float32)  # not stage 3's step agreement (20 int64 over the world)
        if step > 0:
            assert sharded == zero, (step, sharded, zero)
    state = engine.module_state_dict()
    engine.destroy()
    reference = _reference("llama", data)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
