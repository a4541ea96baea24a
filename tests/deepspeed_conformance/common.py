"""zerodist's stand-in for DeepSpeed's ``tests/unit/common.py``: ``DistributedTest``.

A test method of a ``DistributedTest`` subclass runs on ``world_size`` ranks (forked processes on
gloo, ``import deepspeed`` served by zerodist); conftest.py's ``pytest_pyfunc_call`` does it. Copied
into the work directory as ``unit/common.py`` by run.py.
"""

from __future__ import annotations

import os
import socket


class DistributedTest:
    world_size: int | list[int] = 2
    reuse_dist_env = False
    requires_cuda_env = False
    init_distributed = True
    set_dist_env = True
    exec_timeout = 120


class DistributedFixture(DistributedTest):
    """Not supported: its tests are reported as failed with this reason."""


def get_master_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def preferred_dtype():  # noqa: ANN201 - DeepSpeed's helper
    import torch

    return torch.float32 if not os.environ.get("ZERODIST_CONFORMANCE_DTYPE") else getattr(torch, os.environ[
        "ZERODIST_CONFORMANCE_DTYPE"])


def reduce_boolean_flags(flag: bool, op=all) -> bool:  # noqa: ANN001 - DeepSpeed's helper
    """`op` over every rank's `flag` (the flag itself without a process group)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    flags = [torch.zeros(1, dtype=torch.int) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(bool(flag))], dtype=torch.int))
    return op(bool(f.item()) for f in flags)


def allclose_on_all_ranks(actual, expected, assert_message=None, **kwargs) -> None:  # noqa: ANN001
    """Every rank passes or fails together: `torch.testing.assert_close` on each, the verdict all-reduced."""
    import torch

    try:
        torch.testing.assert_close(actual, expected, **kwargs)
        local, message = True, ""
    except AssertionError as error:
        local, message = False, str(error)
    if not reduce_boolean_flags(local, all):
        raise AssertionError(assert_message or message or "tensors differ on another rank")


def enable_determinism(seed: int):  # noqa: ANN201 - DeepSpeed's decorator: seeded by rank, restored after
    import functools
    import random

    def decorator(func):  # noqa: ANN001, ANN202
        @functools.wraps(func)
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            import numpy
            import torch

            rank_seed = seed + int(os.getenv("LOCAL_RANK", "0"))
            saved = random.getstate(), numpy.random.get_state(), torch.get_rng_state(), \
                torch.are_deterministic_algorithms_enabled()
            random.seed(rank_seed)
            numpy.random.seed(rank_seed)
            torch.manual_seed(rank_seed)
            torch.use_deterministic_algorithms(True)
            try:
                return func(*args, **kwargs)
            finally:
                random.setstate(saved[0])
                numpy.random.set_state(saved[1])
                torch.set_rng_state(saved[2])
                torch.use_deterministic_algorithms(saved[3])

        return wrapper

    return decorator
