"""Lightning's ``Trainer`` with the model, its accumulation, clipping and checkpoints handed to a
zerodist engine: ``Trainer(strategy=ZerodistStrategy(config=...))``, or by name once this module
is imported: ``"zerodist"``, ``"zerodist_stage_1"``, ``"zerodist_stage_2"``, ``"zerodist_stage_3"``.

    import zerodist.integrations.lightning  # registers the names
    trainer = lightning.Trainer(strategy="zerodist_stage_3", accelerator="cpu", devices=2,
                                accumulate_grad_batches=2, gradient_clip_val=1.0)

The public extension point is Lightning's own (a ``Strategy`` subclass, as Lightning's
``DeepSpeedStrategy``): the engine is built in ``setup`` from the LightningModule's
``configure_optimizers`` (or the config's optimizer), the model is never wrapped in DDP,
``handles_gradient_accumulation`` makes every batch an optimizer step that the engine turns into
one step per window, the precision plugin routes backward and step to the engine, and checkpoints
are the engine's (sharded, any world size), holding Lightning's own state as client state.
Precision (bf16/fp16) comes from the zerodist config, not from ``Trainer(precision=...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

import zerodist
from zerodist.config import Config
from zerodist.config.source import read_source

_CHECKPOINT_TAG = "checkpoint"  # one tag per checkpoint directory, as Lightning's DeepSpeed strategy


class ZerodistPrecision(Precision):
    """Backward and step through the engine; it clips (``gradient_clipping``) and scales."""

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning already divided the loss by accumulate_grad_batches.
        model.trainer.model.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()  # training_step and backward
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ValueError("ZerodistStrategy: training_step returned None (skipping backward), which the engine's "
                             "accumulation cannot follow; return the loss")
        return model.trainer.model.step()

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        return None  # the engine clips by the global norm at its step


class ZerodistStrategy(DDPStrategy):
    strategy_name = "zerodist"

    def __init__(self, config: Any = None, *, stage: int | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 process_group_backend: str | None = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=ZerodistPrecision(),
                         process_group_backend=process_group_backend)
        self.zerodist_config = config if config is not None else {}
        self.stage = stage
        self.engine: Any = None

    @property
    def precision_plugin(self) -> Precision:
        assert self._precision_plugin is not None, "the setter always gives one"
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector gives a strategy picked by name its default plugin after construction;
        # backward and step must still go through the engine, and precision is the config's.
        if plugin is not None and not isinstance(plugin, ZerodistPrecision):
            if getattr(plugin, "precision", "32-true") != "32-true":
                raise ValueError(f"ZerodistStrategy: precision comes from the zerodist config ('bf16'/'fp16'), "
                                 f"not Trainer(precision={plugin.precision!r})")
            plugin = ZerodistPrecision()
        self._precision_plugin = plugin

    # ---------------------------------------------------------------- building the engine
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            raise ValueError(f"ZerodistStrategy runs fit() only, not {getattr(trainer.state.fn, 'value', None)}()")
        config = self._resolved_config(trainer)
        optimizer, scheduler_config = None, None
        if config.optimizer is None:
            assert self.lightning_module is not None  # attached before setup()
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError("ZerodistStrategy takes one optimizer and at most one scheduler from "
                                 f"configure_optimizers, got {len(optimizers)} and {len(schedulers)}")
            optimizer, scheduler_config = optimizers[0], (schedulers[0] if schedulers else None)
        scheduler = None if scheduler_config is None else scheduler_config.scheduler
        self.engine, *_ = zerodist.initialize(model=self.model, optimizer=optimizer, lr_scheduler=scheduler,
                                              config=config)
        if scheduler_config is not None:
            # Lightning steps the scheduler on its interval; initialize() pointed it at the sharded optimizer.
            scheduler_config.scheduler = self.engine.lr_scheduler
            self.engine.lr_scheduler = None
            self.lr_scheduler_configs = [scheduler_config]
        self.model = self.engine
        self.optimizers = [self.engine.optimizer]
        self.barrier()

    def _resolved_config(self, trainer: pl.Trainer) -> Config:
        """The config with what Lightning's Trainer decides: accumulation, clipping, micro-batch, stage."""
        if isinstance(self.zerodist_config, Config):
            raw = self.zerodist_config.to_dict()
        else:
            raw = dict(self.zerodist_config) if isinstance(self.zerodist_config, Mapping) \
                else read_source(self.zerodist_config)[0]
        raw["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("ZerodistStrategy clips by the global norm only, not gradient_clip_algorithm="
                             f"{trainer.gradient_clip_algorithm!r}")
        raw.setdefault("gradient_clipping", trainer.gradient_clip_val or 0.0)
        raw.setdefault("steps_per_print", float("inf"))  # Lightning logs; the engine's lines would repeat it
        if raw.get("train_micro_batch_size_per_gpu") in (None, "auto"):
            raw["train_micro_batch_size_per_gpu"] = _loader_batch_size(trainer)
        raw.pop("train_batch_size", None)  # implied by the other two and the world
        if self.stage is not None:
            raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": self.stage}
        return Config.load(raw)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self.optimizers, self.lr_scheduler_configs = [], []  # built with the engine in setup()

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # never DDP

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def zero_stage(self) -> int:
        if self.stage is not None:
            return self.stage
        raw = self.zerodist_config
        if isinstance(raw, Config):
            return raw.zero_optimization.stage
        raw = raw if isinstance(raw, Mapping) else read_source(raw)[0]
        return int(raw.get("zero_optimization", {}).get("stage", 0))

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """At stage 3 the model is built on the meta device, every rank's shard materialised by the engine."""
        if self.zero_stage == 3:
            with zerodist.zero.Init():
                yield
        else:
            yield

    # ---------------------------------------------------------------- checkpoints through the engine
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine's checkpoint holds the model, sharded

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("ZerodistStrategy saves through the engine: storage_options is not used")
        filepath = self.broadcast(str(filepath))
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=_CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(checkpoint_path), tag=_CHECKPOINT_TAG)
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        return None  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None  # loaded by load_checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("zerodist", cls, description="zerodist's ZeRO engine, the config's stage")
        for stage in (1, 2, 3):
            strategy_registry.register(f"zerodist_stage_{stage}", cls, description=f"zerodist ZeRO stage {stage}",
                                       stage=stage)


def _loader_batch_size(trainer: pl.Trainer) -> int:
    source = trainer.fit_loop._data_source
    loader = source.dataloader() if source.is_defined() else None
    batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if batch_size is None:
        raise ValueError("ZerodistStrategy: the train loader has no batch size to read; set "
                         "'train_micro_batch_size_per_gpu' in the config")
    return batch_size


if "zerodist" not in StrategyRegistry:
    ZerodistStrategy.register_strategies(StrategyRegistry)
