"""DeepSpeed's optimizer classes, for ``isinstance(engine.optimizer, ...)`` in DeepSpeed scripts and tests.

DeepSpeed's engine wraps the torch optimizer in one of several classes, by stage:
``DeepSpeedZeroOptimizer`` (``deepspeed.runtime.zero.stage_1_and_2``, stages 1 and 2),
``DeepSpeedZeroOptimizer_Stage3`` (stage 3), all ``ZeROOptimizer``s (``deepspeed.runtime.base_optimizer``).
zerodist's engine has one, ``zerodist.zero.ZeroOptimizer``, at every stage; these classes answer
``isinstance`` for it by the stage its flat groups shard at (none of them is ever constructed).
``BF16_Optimizer`` (DeepSpeed's bf16 optimizer for stages 0-1 with fp32 gradient accumulation) has no
counterpart here: nothing is an instance of it.
"""

from __future__ import annotations

from typing import Any

from zerodist.engine.deepspeed_surface import live_engines
from zerodist.zero import ZeroOptimizer


def optimizer_stage(optimizer: Any) -> int | None:
    """The ZeRO stage a `ZeroOptimizer` steps at: its engine's configured stage (DeepSpeed picks the
    class by it, whatever the world size), else what its flat groups shard; None for anything else."""
    if not isinstance(optimizer, ZeroOptimizer):
        return None
    for engine in live_engines():
        if engine.optimizer is optimizer:
            return int(engine.stage)
    stage = 0
    for group in optimizer.groups:
        policy = group.policy
        stage = max(stage, 3 if policy.shard_parameters else 2 if policy.shard_gradients else
                    1 if policy.shard_optimizer_state else 0)
    return stage


class _StageCheck(type):
    """`isinstance(x, cls)`: x is a `ZeroOptimizer` stepping at one of `cls.stages`."""

    stages: tuple[int, ...] = ()

    def __instancecheck__(cls, instance: Any) -> bool:
        return optimizer_stage(instance) in cls.stages

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} is DeepSpeed's optimizer class; under zerodist, deepspeed.initialize() "
                        "builds the engine's optimizer (zerodist.zero.ZeroOptimizer), which answers isinstance "
                        f"checks against {cls.__name__} by its ZeRO stage")


class ZeROOptimizer(metaclass=_StageCheck):
    """Every ZeRO stage's optimizer (DeepSpeed's base class)."""

    stages = (0, 1, 2, 3)


class DeepSpeedZeroOptimizer(metaclass=_StageCheck):
    """Stages 1 and 2 (DeepSpeed's `stage_1_and_2`)."""

    stages = (1, 2)


class DeepSpeedZeroOptimizer_Stage3(metaclass=_StageCheck):  # noqa: N801 - DeepSpeed's name
    stages = (3,)


class BF16_Optimizer(metaclass=_StageCheck):  # noqa: N801 - DeepSpeed's name
    """No zerodist optimizer is one: zerodist's bf16 training is the same `ZeroOptimizer`."""

    stages = ()
