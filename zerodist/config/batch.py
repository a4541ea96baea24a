"""Batch-size arithmetic: DeepSpeed's triple, resolved for a data-parallel world size.

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size

Pure functions over integers; the world size is an argument (with where it came from, for
the error text) because the config layer runs before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodist.config.errors import ConfigError

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_STEPS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triple; ``train == micro x steps x world size`` always holds."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    *,
    world_size: int,
    world_size_source: str,
) -> BatchSizes:
    """Fill in the absent (None) members of the triple.

    Any two give the third. One alone: train -> 1 step, micro = train / world size;
    micro -> 1 step; steps -> micro 1. None at all -> micro 1, 1 step.
    Raises ConfigError with the whole equation when the numbers cannot agree.
    """
    _check_counts(
        train_batch_size,
        micro_batch_size,
        gradient_accumulation_steps,
        world_size,
        world_size_source,
    )
    world = f"data-parallel world size ({world_size}, from {world_size_source})"
    train, micro, steps = train_batch_size, micro_batch_size, gradient_accumulation_steps
    if micro is None and steps is None:
        steps = 1  # DeepSpeed's choice when at most the train size is given
    if train is not None and micro is None:
        equation = _equation(train, None, steps, world)
        assert steps is not None  # set to 1 above when micro and steps were both absent
        micro = _divide(train, steps, world_size, solving=_MICRO, equation=equation)
    elif train is not None and steps is None:
        equation = _equation(train, micro, None, world)
        assert micro is not None  # the branch above took micro is None
        steps = _divide(train, micro, world_size, solving=_STEPS, equation=equation)
    # Without a train size, whatever is still absent is 1 (checked >= 1 above, so `or` is safe).
    micro, steps = micro or 1, steps or 1
    product = micro * steps * world_size
    if train is not None and train != product:
        raise ConfigError(f"{_equation(train, micro, steps, world)} = {product}")
    return BatchSizes(product, micro, steps)


def _divide(train: int, known: int, world_size: int, *, solving: str, equation: str) -> int:
    """``train / (known x world_size)``, or a ConfigError naming the nearest sizes that work."""
    divisor = known * world_size
    if train % divisor == 0:
        return train // divisor
    lower, upper = train // divisor * divisor, (train // divisor + 1) * divisor
    nearest = f"{lower} or {upper}" if lower > 0 else str(upper)
    raise ConfigError(
        f"{equation}, but {train} / ({known} x {world_size}) = {train / divisor:g} is not a whole "
        f"number of {solving}; the nearest {_TRAIN} that works is {nearest}"
    )


def _equation(train: int | None, micro: int | None, steps: int | None, world: str) -> str:
    def term(name: str, value: int | None) -> str:
        return name if value is None else f"{name} ({value})"

    return (
        f"{term(_TRAIN, train)} must equal {term(_MICRO, micro)} x {term(_STEPS, steps)} x {world}"
    )


def _check_counts(
    train: object, micro: object, steps: object, world_size: object, world_size_source: str
) -> None:
    problems = [
        f"{name} must be an integer >= 1 or absent, got {value!r}"
        for name, value in ((_TRAIN, train), (_MICRO, micro), (_STEPS, steps))
        if value is not None and not _is_positive_int(value)
    ]
    if not _is_positive_int(world_size):
        problems.append(
            f"data-parallel world size must be an integer >= 1, got {world_size!r}"
            f" (from {world_size_source})"
        )
    if problems:
        raise ConfigError(problems)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
