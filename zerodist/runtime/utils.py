"""`deepspeed.runtime.utils`'s helpers that user scripts call."""

from __future__ import annotations

import random

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch's (DeepSpeed's function): the
    PRNGs a training script commonly draws from."""
    import numpy
    import torch

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"set_random_seed(seed) takes an int, got {type(seed).__name__}")
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
