"""The GPU tier ([docs/gpu.md]): a test marked `gpu` is skipped, with the reason, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("the GPU tier needs a CUDA device and torch sees none (torch.cuda.is_available() is False); "
                    "run `python -m benchmarks.gpu_tier` on a machine with one")
