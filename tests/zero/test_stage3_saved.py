"""ZeRO stage 3: views of gathered parameters saved for backward ([Note: saved parameter views])."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zerodist
import zerodist.comm as comm
from zerodist.models import GPT, gpt_config
from tests.engine_helpers import base_config
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

NO_REUSE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _ids(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, 33), generator=torch.Generator().manual_seed(step))


@distributed_test(world_size=2)
def test_freed_units_buffers_are_not_held_by_autograd_until_backward():
    """At reuse 0 every block is resharded after its forward; the weight views `F.linear` saves
    must not keep its gathered buffer alive until backward (that was twice the model)."""
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=GPT(gpt_config("tiny", n_layers=4)),
                                          config=base_config(3, zero_optimization=NO_REUSE))
    blocks = engine.stage3.units[1:]
    assert len(blocks) == 4 and not engine.stage3.kept
    seen: list[weakref.ref] = []

    def remember(unit):  # runs after the runtime's pre-hook: the unit is gathered
        # the storage, not the tensor: a saved view keeps the storage alive after the buffer is dropped
        return lambda module, args: seen.extend(weakref.ref(g.param_buffer.untyped_storage()) for g in unit.groups)

    for unit in blocks:
        unit.module.register_forward_pre_hook(remember(unit))
    rank = comm.get_rank()
    ids = _ids(0, 4)[2 * rank: 2 * rank + 2]
    loss = engine(ids[:, :-1], ids[:, 1:])
    gc.collect()
    assert len(seen) == 4
    # Freed, or back in the engine's buffer pool for the next gather ([Note: buffer pool]), which
    # takes a buffer back only when nothing else (autograd) holds its storage.
    # gloo's worker thread may hold a gathered buffer for a moment after its gather (see that Note):
    # give it up to 10 s (a loaded machine can hold that thread off for more than the second this was),
    # which is nothing to autograd's hold: that lasts until the backward below, so a longer wait
    # lets nothing through that autograd holds.
    deadline = time.monotonic() + 10
    while True:
        pooled = {b.untyped_storage().data_ptr() for b in blocks[0].groups[0].buffer_pool.free_buffers}
        alive = sum(s is not None and s.data_ptr() not in pooled for s in (ref() for ref in seen))  # holds none
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not alive, f"{alive} of 4 freed blocks' gathered buffers still held after forward"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # every unit left its hooks
    engine.backward(loss)
    assert all(u.state.value == "sharded" for u in blocks)
    engine.step()


def _train(config, model, steps=3):
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    rank = comm.get_rank()
    losses = []
    for step in range(steps):
        ids = _ids(step, 4)[2 * rank: 2 * rank + 2]
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, engine.module_state_dict(), losses


@distributed_test(world_size=2)
def test_no_reuse_bitwise_equal_to_stage_0_and_full_reuse():
    """The rebuilt views read the same values: stage 3 without reuse equals stage 3 with every
    unit kept (no hooks) and stage 0, bitwise."""
    runs = []
    for stage, zero in [(3, NO_REUSE), (3, {"stage3_param_persistence_threshold": 0}),
                        (0, {"stage3_param_persistence_threshold": 0})]:
        torch.manual_seed(0)
        runs.append(_train(base_config(stage, zero_optimization=zero), GPT(gpt_config("tiny", n_layers=4))))
    assert not runs[0][0].stage3.kept and runs[1][0].stage3.kept
    for engine, state, losses in runs[1:]:
        assert losses == runs[0][2]
        for key in state:
            assert torch.equal(state[key], runs[0][1][key]), key


class CheckpointedBlock(nn.Module):
    """A unit whose MLP is activation-checkpointed inside its own forward."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.mlp, x, use_reentrant=False)


class CheckpointedModel(nn.Module):
    """Embedding, four units, head; `whole`: each unit is itself checkpointed from outside."""

    def __init__(self, whole: bool, dim: int = 32):
        super().__init__()
        self.whole = whole
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(CheckpointedBlock(dim) for _ in range(4))
        self.head = nn.Linear(dim, 256)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.whole else block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("whole", [False, True])
@distributed_test(world_size=2)
def test_activation_checkpointing_at_stage_3_without_reuse(whole):
    """torch.utils.checkpoint inside a unit (and around a whole unit) gives stage 0's results."""
    runs = []
    for stage in (3, 0):
        torch.manual_seed(0)
        runs.append(_train(base_config(stage, zero_optimization=NO_REUSE), CheckpointedModel(whole)))
    assert len(runs[0][0].stage3.units) == 5 and not runs[0][0].stage3.kept
    assert runs[0][2] == runs[1][2]
    for key in runs[1][1]:
        assert torch.equal(runs[0][1][key], runs[1][1][key]), key


@distributed_test(world_size=2)
def test_outer_saved_tensor_hooks_still_see_activations():
    """Hooks active around the engine (save_on_cpu, a profiler) still get every tensor but the
    parameter views, and results are unchanged."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layers=4))
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(3, zero_optimization=NO_REUSE))
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    def unpack(tensor):
        unpacked.append(tensor.shape)
        return tensor

    rank = comm.get_rank()
    ids = _ids(0, 4)[2 * rank: 2 * rank + 2]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = engine(ids[:, :-1], ids[:, 1:])
    engine.backward(loss)
    # activations inside the blocks (e.g. the MLP's hidden layer: batch x seq x 4*dim) reach the outer hooks
    assert len(packed) > 20 and len(unpacked) == len(packed)
    assert any(shape[-1] == 4 * model.config.d_model for shape in packed)
    engine.step()
