"""``deepspeed.moe.sharded_moe``: DeepSpeed's module path for the gate and the MoE layer
(``TopKGate``, ``MOELayer``), which zerodist keeps in ``zerodist.moe.gating`` and ``zerodist.moe.layer``."""

from zerodist.moe.gating import TopKGate
from zerodist.moe.layer import MOELayer

__all__ = ["MOELayer", "TopKGate"]
