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
