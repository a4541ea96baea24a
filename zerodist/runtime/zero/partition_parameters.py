"""``deepspeed.runtime.zero.partition_parameters``: the names transformers and TRL reach into.

transformers' ``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor``
(DeepSpeed's ``zero.Init`` wraps torch's tensor constructors to cast them) around model construction;
the served ``zero.Init`` wraps no constructor (it cuts each module's parameters once built, with the
dtype they were built in: [Note: partitioned construction] in zerodist/zero/init_shards.py), so the
wrapper here hands the constructor back unchanged. ``ZeroParamStatus`` is DeepSpeed's enum;
zerodist sets no such attribute on parameters (``zerodist.zero.is_sharded`` answers the question, for
parameters cut by the served ``Init`` too).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from zerodist.runtime.zero.served import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., Any]:
    """`fn` unchanged: the served `zero.Init` does not wrap torch's constructors."""
    return fn
