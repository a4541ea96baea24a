"""zerodist's stand-in for the two helpers of DeepSpeed's ``tests/unit/util.py`` the fetched files use
(copied into the work directory as ``unit/util.py`` by run.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def skip_on_arch(min_arch: int = 7) -> None:
    """DeepSpeed skips below a CUDA compute capability; nothing to skip on the CPU."""
    return None


def skip_on_cuda(valid_cuda: Any) -> None:
    return None


@contextlib.contextmanager
def no_child_process_in_deepspeed_io() -> Iterator[None]:
    yield


def bf16_required_version_check(accelerator_check: bool = True) -> bool:
    """DeepSpeed's answer on a CPU-only machine: False (it needs CUDA >= 11 and NCCL >= 2.10, or an
    NPU/HPU/XPU), so DeepSpeed's bf16 tests skip here as they do under DeepSpeed on the CPU."""
    return False


def required_amp_check() -> bool:
    from importlib.util import find_spec

    return find_spec("apex") is not None


def torch_assert_equal(actual: Any, expected: Any, **kwargs: Any) -> None:
    import torch

    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0, **kwargs)


def torch_assert_close(actual: Any, expected: Any, **kwargs: Any) -> None:
    import torch

    torch.testing.assert_close(actual, expected, **kwargs)


def torch_assert_dicts_of_tensors_equal(actual: Any, expected: Any, **kwargs: Any) -> None:
    assert actual.keys() == expected.keys(), f"keys differ: {sorted(actual)} vs {sorted(expected)}"
    for key in actual:
        torch_assert_equal(actual[key], expected[key], **kwargs)
