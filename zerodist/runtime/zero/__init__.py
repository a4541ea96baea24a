"""``deepspeed.runtime.zero``: the served ``deepspeed.zero`` names under DeepSpeed's runtime path
(``GatheredParameters``, ``Init``), and ``partition_parameters``."""

from zerodist.integrations.deepspeed_zero import GatheredParameters, Init
from zerodist.runtime.zero import partition_parameters

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
