"""``deepspeed.zero`` and ``deepspeed.runtime.zero`` when zerodist serves ``import deepspeed``: zerodist's
``zero`` module with ``Init`` (partitioned construction) and ``GatheredParameters`` as served to
transformers (served.py), and ``partition_parameters``."""

from typing import Any

import zerodist.zero as _zero
from zerodist.runtime.zero import partition_parameters
from zerodist.runtime.zero.served import GatheredParameters, Init
from zerodist.runtime.zero.stage3 import unwrap_model_for_generation
from zerodist.zero.init_shards import register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "partition_parameters", "register_external_parameter",
           "unregister_external_parameter", "unwrap_model_for_generation"]


def __getattr__(name: str) -> Any:
    return getattr(_zero, name)  # the rest of deepspeed.zero is zerodist.zero's
