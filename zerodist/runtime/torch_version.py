"""``deepspeed.utils.torch``: ``required_torch_version``, as DeepSpeed's tests and examples call it."""

from __future__ import annotations

import torch
from packaging import version


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether the installed torch (its release, without a local label) lies within [min_version, max_version]."""
    installed = version.parse(version.parse(torch.__version__).base_version)
    if min_version is not None and installed < version.parse(str(min_version)):
        return False
    return max_version is None or installed <= version.parse(str(max_version))
