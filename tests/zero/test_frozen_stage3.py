"""Frozen parameters at ZeRO-3 ([Note: frozen parameters at stage 3] in zerodist/zero/apply.py).

A LoRA-style model (each block's base layers frozen, a low-rank adapter trained beside them, a frozen
input layer and a trained head in the root) trains at stage 3 on 2 ranks with the losses and weights
of one process; its frozen weights are sharded like the trained ones, gathered with their unit, and
freed in backward once the unit is done; checkpoints, `GatheredParameters` and the 16-bit export see
their whole values.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import zerodist
from zerodist.checkpoint import CheckpointWriteError
from zerodist.checkpoint.manifest import read_manifest
import zerodist.comm as comm
from zerodist.zero import GatheredParameters, is_sharded
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

IN, WIDTH, OUT, DEPTH, ROWS = 8, 16, 4, 4, 4
UNITS = {"zerodist": {"stage3_unit_classes": ["Block"]},
         "zero_optimization": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                               "stage3_prefetch_bucket_size": 0}}


class Adapted(torch.nn.Module):
    """A frozen linear layer with a trained low-rank update beside it (LoRA's shape)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = torch.nn.Linear(d_in, d_out)
        self.down = torch.nn.Linear(d_in, rank, bias=False)
        self.up = torch.nn.Linear(rank, d_out, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = Adapted(width, 2 * width), Adapted(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class AdaptedNet(torch.nn.Module):
    def __init__(self, checkpointing: str | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(IN, WIDTH).requires_grad_(False)  # frozen, in the root
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, OUT)  # trained, in the root
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.checkpointing == "reentrant":
            h = h.requires_grad_(True)  # what transformers' enable_input_require_grads does for PEFT
        if self.checkpointing == "reentrant-region":  # one region around every block (checkpoint_sequential's way)
            h = torch.utils.checkpoint.checkpoint(self._blocks, h.requires_grad_(True), use_reentrant=True)
            return self.head(h)
        for block in self.blocks:
            if self.checkpointing is None:
                h = block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h)

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def _config(stage: int = 3, **extra: object) -> dict:
    config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {**UNITS["zero_optimization"], "stage": stage}, "zerodist": UNITS["zerodist"]}
    return {**config, **extra}


def _reference(steps: int, rows: int, checkpointing: str | None = None) -> tuple[list[float], dict]:
    model = AdaptedNet(checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rows)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(engine, steps: int, first: int = 0) -> list[float]:
    n, rank, losses = comm.get_world_size(), comm.get_rank(), []
    for step in range(first, first + steps):
        x, y = _batch(step, ROWS * n)
        loss = F.mse_loss(engine(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / n)
    return losses


def _frozen_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
@distributed_test(world_size=2)
def test_adapters_train_like_one_process_with_the_frozen_base_sharded(checkpointing):
    """Losses and weights within 1e-6 of one process; each rank holds half the frozen weights; every
    unit is gathered once in forward and once in backward (a reentrant checkpoint's recompute too) and
    freed there: no more than the root and two blocks are ever gathered (without freeing in backward
    it would be the root and all four), and no frozen weight needs a second gather (a unit freed
    before its frozen weights' backward)."""
    model = AdaptedNet(checkpointing)
    frozen_total = _frozen_numel(model)
    engine, _, _, _ = zerodist.initialize(model=model, config=_config())
    state = engine.zero_state
    assert len(state.frozen_groups) == DEPTH + 1  # one per block, one in the root (embed)
    assert all(g.master is None and not g.buckets and g.grad_shard is None for g in state.frozen_groups)
    held = sum(g.param_shard.numel() for g in state.frozen_groups)
    assert frozen_total / 2 <= held < frozen_total / 2 + 64 * (DEPTH + 1) * 2  # half, and the padding
    assert all(is_sharded(p) for p in model.blocks[0].fc1.base.parameters())

    runtime = state.runtime
    gathers: list[int] = []
    original = runtime.unshard

    def counted(units=None, *, kind=0):  # noqa: ANN001, ANN202 - the runtime's own signature
        gathers.extend(u.index for u in units if u.state.value == "sharded")
        return original(units, kind=kind)

    runtime.unshard = counted  # our object, not the user's
    losses = _train(engine, 5)
    peak, gathered = runtime.peak_live_numel, len(gathers)  # before module_state_dict(), which gathers every unit
    expected_losses, expected = _reference(5, ROWS * comm.get_world_size(), checkpointing)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-6, atol=1e-7)
    final = engine.module_state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-6, atol=1e-6, msg=key)
    block = state.units[1].numel
    assert peak <= state.units[0].numel + 2 * block, (peak, state.units[0].numel, block)
    # A block is gathered for its forward and for its backward. A non-reentrant checkpoint recomputes
    # inside the backward's gather; a reentrant one gathers for its recompute, which runs inside the
    # backward, and the block stays gathered for the inner backward that follows.
    per_step = 1 + DEPTH * 2
    # and the root once more: the last step gathers it early for a next forward ([Note: early gather])
    assert gathered == 5 * per_step + 1, (gathered, gathers[:per_step * 2])
    engine.destroy()


@distributed_test(world_size=2)
def test_a_region_of_units_recomputed_in_backward_stays_within_max_live_parameters():
    """One reentrant checkpoint around all four blocks: the recompute runs every block's forward
    before the first block's backward. A recomputed unit stays gathered for its backward only while
    the gathered total fits stage3_max_live_parameters (here the root and two blocks), so the peak
    stays there, and the losses are one process's."""
    model = AdaptedNet("reentrant-region")
    root = sum(p.numel() for m in (model.embed, model.head) for p in m.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    config = _config()
    config["zero_optimization"]["stage3_max_live_parameters"] = root + 2 * block + 64 * 2 * 3  # and padding
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    state = engine.zero_state
    losses = _train(engine, 3)
    expected_losses, _ = _reference(3, ROWS * comm.get_world_size(), "reentrant-region")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-6, atol=1e-7)
    assert state.runtime.peak_live_numel <= state.units[0].numel + 2 * state.units[1].numel, \
        (state.runtime.peak_live_numel, state.units[0].numel, state.units[1].numel)
    engine.destroy()


@distributed_test(world_size=2)
def test_a_frozen_copy_failing_on_one_rank_fails_the_save_on_every_rank_and_training_goes_on():
    """The host copy of a frozen group runs out of memory on rank 0 only (simulated): every rank
    raises CheckpointWriteError naming it, nothing is committed, and the ranks are still in step
    (two more steps equal an engine that never tried to save)."""
    engine, _, _, _ = zerodist.initialize(model=AdaptedNet(), config=_config())
    _train(engine, 1)
    directory = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    original = torch.Tensor.to

    def out_of_memory(self, *args, **kwargs):  # noqa: ANN001, ANN202 - torch.Tensor.to's signature
        if kwargs.get("copy") and str(args[0] if args else kwargs.get("device")) == "cpu":
            raise MemoryError("host out of memory (simulated)")
        return original(self, *args, **kwargs)

    if comm.get_rank() == 0:
        torch.Tensor.to = out_of_memory  # this test's process only, undone below
    try:
        with pytest.raises(CheckpointWriteError, match="rank 0: MemoryError: host out of memory"):
            engine.save_checkpoint(directory[0], tag="t")
    finally:
        torch.Tensor.to = original
    assert not (Path(directory[0]) / "t" / "manifest.json").exists()
    losses = _train(engine, 2, first=1)
    expected, _ = _reference(3, ROWS * comm.get_world_size())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[1:]), rtol=1e-6, atol=1e-7)
    engine.destroy()


@distributed_test(world_size=2)
def test_a_frozen_reference_model_is_sharded_and_gives_the_models_outputs():
    """TRL's reference model (every parameter frozen, no optimizer) at stage 3: sharded, and its
    outputs (no_grad and with grad, as DPO computes them) equal the plain model's."""
    reference = AdaptedNet().requires_grad_(False)
    model = copy.deepcopy(reference)
    engine, _, _, _ = zerodist.initialize(model=model, config={k: v for k, v in _config().items() if k != "optimizer"})
    assert not engine.zero_state.groups and len(engine.zero_state.frozen_groups) == DEPTH + 1
    held = sum(g.param_shard.numel() for g in engine.zero_state.frozen_groups)
    assert held < _frozen_numel(reference) / 2 + 64 * 2 * (DEPTH + 1)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(comm.get_rank()))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    assert torch.equal(engine(x), reference(x))
    assert engine.zero_state.runtime.live_numel <= engine.zero_state.units[0].numel  # the blocks freed again
    engine.destroy()


@distributed_test(world_size=2)
def test_checkpoint_gathered_parameters_and_export_see_whole_frozen_values():
    """A checkpoint stores the frozen weights whole and loads them into a stage-3 engine built from
    other weights and into a stage-1 one; `GatheredParameters` changes one on every rank; the 16-bit
    export writes every frozen weight."""
    engine, _, _, _ = zerodist.initialize(model=AdaptedNet(), config=_config())
    _train(engine, 2)
    with GatheredParameters([engine.module.blocks[1].fc2.base.weight], modifier_rank=0), torch.no_grad():
        if comm.get_rank() == 0:
            engine.module.blocks[1].fc2.base.weight.mul_(2.0)
    saved = engine.module_state_dict()
    plain = AdaptedNet()
    assert torch.equal(saved["blocks.1.fc2.base.weight"], 2 * plain.blocks[1].fc2.base.weight)
    assert torch.equal(saved["blocks.2.fc1.base.weight"], plain.blocks[2].fc1.base.weight)
    directory = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    engine.save_checkpoint(directory[0], tag="t")
    engine.save_16bit_model(directory[0], "weights.bin")
    # each frozen weight is written once, and the writing is spread: each rank held about half of the
    # frozen weights on the host while saving, not all of them
    extra = read_manifest(Path(directory[0]) / "t").extra
    frozen = {key: entry["file"] for key, entry in extra.items() if key.endswith("base.weight")}
    assert set(frozen) == {k for k in saved if k.endswith("base.weight")}
    assert {file.split("-")[1] for file in frozen.values()} == {"r00000", "r00001"}, frozen
    continued = _train(engine, 2, first=2)
    exported = torch.load(f"{directory[0]}/weights.bin")
    for key, value in saved.items():
        assert torch.equal(exported[key], value), key
    for stage in (3, 1):
        other, _, _, _ = zerodist.initialize(model=AdaptedNet(seed=7), config=_config(stage))
        other.load_checkpoint(directory[0], tag="t")
        loaded = other.module_state_dict()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (stage, key)
        torch.testing.assert_close(torch.tensor(_train(other, 2, first=2)), torch.tensor(continued),
                                   rtol=1e-6, atol=1e-7)
        other.destroy()
    engine.destroy()
