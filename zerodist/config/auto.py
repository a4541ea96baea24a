"""``"auto"`` filled the way Hugging Face's Trainer fills it, from the values it would use.

The templates LLaMA-Factory, axolotl and the transformers docs ship write ``"auto"`` for every
value the training arguments already decide (batch sizes, clipping, precision, optimizer and
scheduler settings) and for bucket sizes the model's hidden size decides. transformers'
``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` and ``trainer_config_finalize``) fills
each from one place; ``resolve_auto`` does the same from a `TrainerValues`, so a template means
here what it means under the Trainer. [Note: auto as the Trainer fills it]

Pure: no torch, no transformers. ``zerodist.integrations.transformers`` builds the
`TrainerValues` from ``TrainingArguments`` and the model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from zerodist.config.errors import ConfigError, show_value

# [Note: auto as the Trainer fills it]
# Each rule names a dotted key, where its value comes from, and whether an explicit value must
# agree (transformers' `fill_match`) or is simply kept (`fill_only`). An explicit value that
# disagrees with the arguments is an error, all of them in one round, as in transformers
# ("Please correct the following DeepSpeed config values that mismatch TrainingArguments").
# transformers differs in two places, both to refuse earlier what it would let through:
# an "auto" that nothing fills (a scheduler's total_num_steps before the step count is known)
# is named here instead of reaching DeepSpeed as a string, and the message names both values.


@dataclasses.dataclass(frozen=True)
class TrainerValues:
    """What the Trainer fills ``"auto"`` from: its arguments, the world, the model, the schedule.

    ``None`` means not known (yet): an ``"auto"`` that needs it is an error naming the key.
    """

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    learning_rate: float
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    fp16: bool = False
    bf16: bool = False
    hidden_size: int | None = None
    num_training_steps: int | None = None
    warmup_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class _Rule:
    key: str  # dotted: "optimizer.params.lr"
    value: Any  # None: not known
    source: str  # the argument it comes from, for messages
    must_match: bool = True


def _rules(values: TrainerValues, stage: Any) -> list[_Rule]:
    hidden = values.hidden_size
    rules = [
        _Rule("train_micro_batch_size_per_gpu", values.per_device_train_batch_size, "per_device_train_batch_size"),
        _Rule("gradient_accumulation_steps", values.gradient_accumulation_steps, "gradient_accumulation_steps"),
        _Rule("train_batch_size",
              values.world_size * values.per_device_train_batch_size * values.gradient_accumulation_steps,
              "world_size x per_device_train_batch_size x gradient_accumulation_steps"),
        _Rule("gradient_clipping", values.max_grad_norm, "max_grad_norm"),
        _Rule("optimizer.params.lr", values.learning_rate, "learning_rate"),
        _Rule("optimizer.params.betas", [values.adam_beta1, values.adam_beta2], "[adam_beta1, adam_beta2]"),
        _Rule("optimizer.params.eps", values.adam_epsilon, "adam_epsilon"),
        _Rule("optimizer.params.weight_decay", values.weight_decay, "weight_decay"),
        _Rule("scheduler.params.warmup_min_lr", 0, "0", must_match=False),
        _Rule("scheduler.params.warmup_max_lr", values.learning_rate, "learning_rate"),
        _Rule("fp16.enabled", values.fp16, "fp16"),
        _Rule("bf16.enabled", values.bf16, "bf16"),
        _Rule("zero_optimization.reduce_bucket_size", None if hidden is None else hidden * hidden,
              "hidden_size ** 2", must_match=False),
        _Rule("scheduler.params.total_num_steps", values.num_training_steps, "num_training_steps"),
        # transformers keeps an automatic warm-up positive: DeepSpeed >= 0.19.6 refuses 0.
        _Rule("scheduler.params.warmup_num_steps", None if values.warmup_steps is None
              else max(1, values.warmup_steps), "warmup_steps"),
    ]
    if stage == 3:  # transformers fills these only at stage 3; below it the schema's defaults apply
        rules += [
            _Rule("zero_optimization.stage3_prefetch_bucket_size", None if hidden is None
                  else int(0.9 * hidden * hidden), "0.9 x hidden_size ** 2", must_match=False),
            _Rule("zero_optimization.stage3_param_persistence_threshold", None if hidden is None
                  else 10 * hidden, "10 x hidden_size", must_match=False),
        ]
    return rules


def trainer_source(dotted: str) -> str | None:
    """The Trainer argument an ``"auto"`` at ``dotted`` is filled from, or None when it fills none."""
    values = TrainerValues(world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           max_grad_norm=0.0, learning_rate=0.0)
    return next((rule.source for rule in _rules(values, 3) if rule.key == dotted), None)


def resolve_auto(raw: Mapping[str, Any], values: TrainerValues, *, source: str | None = None) -> dict[str, Any]:
    """A copy of ``raw`` with each ``"auto"`` filled from ``values``, as the Trainer fills it.

    Raises ConfigError naming every explicit value that disagrees with ``values`` (both values),
    and every ``"auto"`` that ``values`` leaves unknown (what to give).
    """
    config = copy.deepcopy(dict(raw))
    stage = config.get("zero_optimization", {}).get("stage") if isinstance(config.get("zero_optimization"),
                                                                          Mapping) else None
    problems = []
    for rule in _rules(values, stage):
        node, name = _node(config, rule.key)
        if node is None or name not in node:
            continue
        current = node[name]
        if isinstance(current, str) and current == "auto":
            if rule.value is None:
                problems.append(f"'{rule.key}' is \"auto\", filled from {rule.source}, which is not known here; "
                                "give a value")
            else:
                node[name] = rule.value
        elif rule.must_match and rule.value is not None and current is not None and current != rule.value:
            problems.append(f"'{rule.key}' is {show_value(current)} but the Trainer's {rule.source} is "
                            f"{show_value(rule.value)}; make them agree, or set the key to \"auto\"")
    if problems:
        raise ConfigError(problems, source=source)
    return config


def drop_trainer_auto(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``raw`` without each ``"auto"`` that the Trainer fills, and the dotted keys taken out: a
    config the Trainer has not filled yet, checked as DeepSpeed's ``zero.Init`` reads it (its pydantic
    sections take an ``"auto"`` as the default; the rest it leaves unread). The Trainer fills them before
    ``initialize()``, which checks the filled config."""
    config = copy.deepcopy(dict(raw))
    values = TrainerValues(world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           max_grad_norm=0.0, learning_rate=0.0)
    dropped = []
    for rule in _rules(values, 3):
        node, name = _node(config, rule.key)
        if node is not None and node.get(name) == "auto":
            del node[name]
            dropped.append(rule.key)
    return config, dropped


def resolve_model_auto(raw: Mapping[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """A copy of ``raw`` whose ``"auto"`` bucket sizes are filled from the model's hidden size by
    the Trainer's formulas (``reduce_bucket_size`` = hidden², and at stage 3 the prefetch bucket
    0.9·hidden² and the persistence threshold 10·hidden), for a config handed to
    ``zerodist.initialize`` without the Trainer. The model decides these, so no Trainer is needed;
    every other ``"auto"`` is left for validation, which names what fills it. With no hidden size
    (a model without a ``config.hidden_size``) the bucket sizes keep their defaults."""
    config = copy.deepcopy(dict(raw))
    if hidden_size is None:
        return config
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    values = TrainerValues(world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           max_grad_norm=0.0, learning_rate=0.0, hidden_size=hidden_size)
    for rule in _rules(values, stage):
        if not rule.key.startswith("zero_optimization.") or "hidden_size" not in rule.source:
            continue
        node, name = _node(config, rule.key)
        if node is not None and node.get(name) == "auto":
            node[name] = rule.value
    return config


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding the last part of ``dotted`` and that part; None when a section is absent."""
    *sections, name = dotted.split(".")
    node: Any = config
    for section in sections:
        node = node.get(section) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, name
    return node, name
