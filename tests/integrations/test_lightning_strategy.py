"""ZerodistStrategy: Lightning's Trainer driving a zerodist engine on 2 gloo ranks, against
zerodist's own loop on the same batches; save and restore through Lightning."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed

pl = pytest.importorskip("lightning.pytorch")

# Two epochs of 10 steps each: Lightning resumes a loader that is not resumable only at an epoch's end.
MICRO, GAS, STEPS, LR, CLIP = 4, 2, 20, 1e-2, 1.0
SAMPLES = 2 * MICRO * GAS * STEPS // 2


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 16, generator=generator),
                                          torch.randn(SAMPLES, 8, generator=generator))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                       torch.nn.GELU(), torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(dataset(), batch_size=MICRO, shuffle=False)


def config(stage: int) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}


def engine_state(engine: Any) -> dict[str, Any]:
    """The model (gathered), this rank's optimizer shard state and the step count."""
    optimizer = engine.optimizer.state_dict()
    return {"model": {k: v.clone() for k, v in engine.module_state_dict().items()}, "steps": engine.global_steps,
            "optimizer": torch.utils._pytree.tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, optimizer)}


class Snapshots(pl.Callback):
    """The engine's state when Lightning saves a checkpoint, and when training starts (after a restore)."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []
        self.started: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.saved.append(engine_state(trainer.strategy.engine))

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.started = engine_state(trainer.strategy.engine)


def lightning_run(strategy: str, root: str, resume: str | None = None) -> dict[str, Any]:
    import zerodist.integrations.lightning  # noqa: F401  (registers the strategy names)

    # Lightning's own checkpoint callback, at each epoch's end, writes through the strategy.
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1)
    snapshots = Snapshots()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, accumulate_grad_batches=GAS,
                         gradient_clip_val=CLIP, logger=False, callbacks=[checkpoints, snapshots],
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(Regression(), ckpt_path=resume)
    assert not any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in trainer.model.modules())
    engine = trainer.strategy.engine
    return {"state": engine_state(engine)["model"], "type": type(trainer.model).__name__, "steps": engine.global_steps,
            "saved": snapshots.saved, "started": snapshots.started, "epoch": trainer.current_epoch}


def native_run(stage: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """zerodist's own loop: each rank reads what Lightning deals it (for training Lightning replaces the
    loader's sampler by a shuffling DistributedSampler, seed 0 unless PL_GLOBAL_SEED says otherwise)."""
    import zerodist
    import zerodist.comm as comm

    module = Regression()
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    engine, *_ = zerodist.initialize(model=module, optimizer=optimizer, config={
        **config(stage), "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP})
    sampler = torch.utils.data.DistributedSampler(dataset(), num_replicas=comm.get_world_size(), rank=comm.get_rank(),
                                                  shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=MICRO, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if engine.global_steps < steps:
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()
    return {"state": state}


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_strategy_ends_with_zerodists_own_parameters(tmp_path, stage):
    ours = run_distributed(lightning_run, 2, f"zerodist_stage_{stage}", str(tmp_path), timeout=240)
    native = run_distributed(native_run, 2, stage, timeout=240)[0]
    for rank in ours:
        assert (rank["type"], rank["steps"]) == ("Engine", STEPS)
        for key, value in native["state"].items():
            torch.testing.assert_close(rank["state"][key], value, atol=1e-6, rtol=0, msg=key)


def test_save_and_restore_through_lightning(tmp_path):
    # Lightning resumes an epoch-end checkpoint of a loader that is not resumable by running one more batch
    # of the finished epoch (DDP does the same), so the runs' later data differ; what must hold is that the
    # restored engine is the saved one: model, this rank's optimizer shard and step count, at stage 3.
    whole = run_distributed(lightning_run, 2, "zerodist_stage_3", str(tmp_path / "whole"), timeout=240)
    half = tmp_path / "whole" / "epoch=0-step=10.ckpt"
    assert (half / "checkpoint").is_dir()  # the engine's sharded checkpoint, Lightning's state inside
    resumed = run_distributed(lightning_run, 2, "zerodist_stage_3", str(tmp_path / "resumed"), str(half),
                              timeout=240)
    for before, after in zip(whole, resumed):
        saved, restored = before["saved"][0], after["started"]
        assert saved["steps"] == restored["steps"] == STEPS // 2
        torch.testing.assert_close(restored["model"], saved["model"], atol=0, rtol=0)
        torch.testing.assert_close(restored["optimizer"], saved["optimizer"], atol=0, rtol=0)
        assert (after["steps"], after["epoch"]) == (STEPS, 2)  # and it trains on to the end
