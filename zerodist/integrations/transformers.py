"""Hugging Face's ``Trainer`` with every training step run by a zerodist engine.

    from zerodist.integrations.transformers import ZerodistTrainer

    trainer = ZerodistTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset,
                              config="ds_z3_config.json")      # a DeepSpeed config, "auto" and all
    trainer.train()
    trainer.save_model("out")                                    # from_pretrained("out") loads it

Every other ``Trainer`` argument keeps its meaning. ``zerodist_trainer_class(SFTTrainer)`` gives
the same for a subclass of ``Trainer``. Launch with ``zerodist run --nproc N script.py`` or torchrun.

[Note: how the Trainer hands its step to the engine]
transformers only knows DeepSpeed by name (it needs an installed distribution called
``deepspeed``), and accelerate wraps a model it prepares in DDP. So nothing here pretends to be
DeepSpeed, and the model never reaches accelerate: this class replaces the few Trainer methods
that decide who owns the model and the step (transformers 5.23-5.x, whose private names these are):
- ``_prepare_for_training`` builds the engine through ``zerodist.initialize`` (the config's
  optimizer and scheduler, else the Trainer's ``create_optimizer`` / ``create_scheduler`` on the
  engine's optimizer) instead of ``accelerator.prepare(model, optimizer)``; the data loader is
  still the Trainer's, so each rank reads the batches it would read under DDP;
- ``training_step`` computes the loss as the Trainer does (``compute_loss``, the same scaling for
  accumulation), then ``engine.backward`` and ``engine.step`` with the Trainer's accumulation
  boundary, so gradients are reduced by ZeRO and clipped once, by the engine;
- the Trainer's own clip, ``optimizer.step()`` and ``lr_scheduler.step()`` become no-ops (the
  engine did them) and its logged learning rate and gradient norm are the engine's;
- the Trainer's ``.to(device)`` of the model is skipped: ``initialize`` places it, and a model built
  in ``zerodist.zero.Init()`` is on the meta device until then;
- checkpoints are zerodist checkpoints (``_save_optimizer_and_scheduler``, resumed in
  ``_prepare_for_training``); the Trainer still writes its state, RNG and the weights;
  ``save_model`` writes Hugging Face weights gathered one unit at a time (``save_pretrained``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import transformers

import zerodist
from zerodist.checkpoint import save_pretrained
from zerodist.config import Config, TrainerValues
from zerodist.config.source import read_source
from zerodist.utils.helpers import model_hidden_size

_BATCH_AND_CLIP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "gradient_clipping")


def trainer_values(args: Any, model: torch.nn.Module, num_training_steps: int | None) -> TrainerValues:
    """What transformers fills a DeepSpeed config's "auto" from, for these ``TrainingArguments``."""
    return TrainerValues(
        world_size=args.world_size, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
        learning_rate=args.learning_rate, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_epsilon=args.adam_epsilon, weight_decay=args.weight_decay,
        fp16=bool(args.fp16 or args.fp16_full_eval), bf16=bool(args.bf16 or args.bf16_full_eval),
        hidden_size=hidden_size(model), num_training_steps=num_training_steps,
        warmup_steps=None if num_training_steps is None else args.get_warmup_steps(num_training_steps))


def hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size as transformers reads it for "auto" bucket sizes (the largest of
    ``hidden_sizes``; a multimodal model's ``text_config``); None when it has none."""
    return model_hidden_size(model)


def load_trainer_config(source: Any, args: Any, model: torch.nn.Module, num_training_steps: int | None) -> Config:
    """The DeepSpeed config with "auto" filled as the Trainer fills it. Batch sizes and clipping
    the config leaves out are the Trainer's too (the Trainer's loop decides them), and the engine
    logs no progress lines unless the config asks (the Trainer logs)."""
    raw, _ = read_source(source) if not isinstance(source, Config) else (source.to_dict(), None)
    # The Trainer logs the loss; accelerate sends DeepSpeed steps_per_print=Infinity for the same reason.
    raw = {**{key: "auto" for key in _BATCH_AND_CLIP_KEYS}, "steps_per_print": float("inf"), **raw}
    return Config.load(raw, auto=trainer_values(args, model, num_training_steps))


class ZerodistTrainerMixin:
    """The Trainer methods that hand the model and the step to the engine ([Note: how the Trainer
    hands its step to the engine]). Put it first among the bases: ``zerodist_trainer_class``."""

    engine: Any = None

    def __init__(self, *args: Any, config: Any, **kwargs: Any) -> None:
        self.zerodist_config_source = config
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self, config)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        # The Trainer enters `accelerator.no_sync(model)` between boundaries unless accelerate's
        # `sync_each_batch` is set. The engine decides when to reduce (set_gradient_accumulation_boundary
        # in training_step; at stages 2-3 it reduces into shards every micro-step), so no_sync must not run.
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True

    # ---------------------------------------------------------------- the engine replaces prepare()
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        if self.engine is None:
            self.engine = self._build_engine(max_steps)
        self.model_wrapped = self.engine
        self.optimizer = _StepDoneByEngine(self.engine)
        self.lr_scheduler = _ScheduleSteppedByEngine(self.engine)
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(resume_from_checkpoint)  # model, optimizer, scheduler, steps
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _build_engine(self, max_steps: int) -> Any:
        config = load_trainer_config(self.zerodist_config_source, self.args, self.model, max_steps)
        optimizer = scheduler = None
        if config.optimizer is None:
            optimizer = self.create_optimizer()  # the Trainer's (or the one given in optimizers=)
        if config.scheduler is None:
            # Built on the optimizer that steps the shards, when initialize() has made it.
            scheduler = self.lr_scheduler or (lambda inner: self.create_scheduler(max_steps, optimizer=inner))
        engine, *_ = zerodist.initialize(model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        return engine

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        # initialize() places the model on its rank's device; one built in zero.Init() is on the meta
        # device until then, and .to() would fail on it.
        return None

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        return self.engine if self.engine is not None else model  # never DDP

    # ---------------------------------------------------------------- one micro-step
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's loss (``compute_loss``, scaled for accumulation as the Trainer scales it),
        then the engine's backward and step at the Trainer's accumulation boundary."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not self._loss_is_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        # Scaled already, as under DeepSpeed (transformers passes scale_wrt_gas=False to it too).
        boundary = self.accelerator.sync_gradients
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)
        if boundary:  # the Trainer logs the rate this step used; the engine's step moves the schedule on
            self.lr_scheduler.rates_of_last_step = self.engine.get_lr()
        self.engine.step()
        return loss.detach()

    def _loss_is_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        # The Trainer's own rule (training_step): normalised over the window by num_items_in_batch.
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # the engine clipped at its step, by the config's gradient_clipping (max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float | None:
        return self.engine.get_global_grad_norm()  # before clipping, as the Trainer logs it

    # ---------------------------------------------------------------- checkpoints and weights
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir)  # every rank: optimizer, scheduler, steps, sharded

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # train() calls this before the engine exists, to load the weights into the bare model; the
        # engine's checkpoint holds them, and _prepare_for_training loads it.
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face weights and config that ``from_pretrained`` loads (gathered from ZeRO-3
        shards one unit at a time); every rank must call it, as it must the Trainer's."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.engine, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


class _StepDoneByEngine:
    """What the Trainer's loop sees as its optimizer: the engine already stepped in training_step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()


class _ScheduleSteppedByEngine:
    """What the Trainer's loop sees as its scheduler: the engine steps the real one."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rates_of_last_step: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        # The Trainer reads this after its optimizer step and before its scheduler step: the rates
        # that step used, which the engine's step (scheduler included) has since moved past.
        return self.rates_of_last_step if self.rates_of_last_step is not None else self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        scheduler = self.engine.lr_scheduler
        return {} if scheduler is None else scheduler.state_dict()


def _refuse_unsupported(trainer: Any, config: Any) -> None:
    """Settings that would hand the model to something else, or that this class does not carry out:
    one error naming each, on every rank, before anything is built."""
    args, problems = trainer.args, []
    if args.deepspeed:
        problems.append("TrainingArguments(deepspeed=...) hands the model to DeepSpeed; give the config to "
                        "ZerodistTrainer(config=...) instead")
    if args.fsdp:
        problems.append(f"TrainingArguments(fsdp={args.fsdp!r}) shards with FSDP; zerodist's ZeRO stage 3 does that")
    for name in ("auto_find_batch_size", "load_best_model_at_end", "torch_compile"):
        if getattr(args, name, False):
            problems.append(f"TrainingArguments({name}=True) is not supported by ZerodistTrainer")
    if trainer.optimizer is not None and _config_has(config, "optimizer"):
        problems.append("an optimizer is given both in optimizers=(...) and in the config's 'optimizer'; give one")
    if problems:
        raise ValueError("ZerodistTrainer: " + "; ".join(problems))


def _config_has(source: Any, key: str) -> bool:
    if isinstance(source, Config):
        return getattr(source, key) is not None
    raw = source if isinstance(source, Mapping) else read_source(source)[0]
    return raw.get(key) is not None


def zerodist_trainer_class(base: type) -> type:
    """``base`` (``transformers.Trainer`` or a subclass of it, such as TRL's ``SFTTrainer``) with
    its model and step handed to a zerodist engine; takes ``config=`` besides ``base``'s arguments."""
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"zerodist_trainer_class takes a transformers.Trainer subclass, got {base!r}")
    missing = [name for name in ("_prepare_for_training", "training_step", "_clip_grad_norm", "_get_grad_norm",
                                 "_save_optimizer_and_scheduler", "_load_from_checkpoint") if not hasattr(base, name)]
    # The mixin's training_step replaces the Trainer's (and a subclass's own wrapper of it, such as
    # SFTTrainer's activation-offloading context): it must take what the Trainer's loop passes.
    if "num_items_in_batch" not in inspect.signature(transformers.Trainer.training_step).parameters:
        missing.append("training_step(..., num_items_in_batch)")
    if missing:
        raise ImportError(f"transformers {transformers.__version__}'s Trainer lacks {', '.join(missing)}; "
                          "ZerodistTrainer is written for transformers 5.23 to 5.x")
    return type(f"Zerodist{base.__name__}", (ZerodistTrainerMixin, base), {"__module__": __name__})


ZerodistTrainer = zerodist_trainer_class(transformers.Trainer)
