"""``deepspeed.moe.sharded_moe``: DeepSpeed's gating functions with DeepSpeed's outputs
(``top1gating``, ``top2gating``, ``topkgating`` and the sparse-route helpers, in
``zerodist.moe.deepspeed_gating``), its ``_AllToAll`` (the capacity path's all-to-all), and the
gate and layer classes, which zerodist keeps in ``zerodist.moe.gating`` and ``zerodist.moe.layer``.
``dist`` is ``deepspeed.comm`` (``zerodist.comm``), as in DeepSpeed's module."""

from zerodist import comm as dist
from zerodist.moe.deepspeed_gating import (
    TUTEL_INSTALLED,
    _capacity,
    _route_slots,
    _sparse_decode,
    _sparse_encode,
    exp_selection_uniform_map,
    gumbel_map,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
    uniform_map,
)
from zerodist.moe.dispatch import _AllToAll
from zerodist.moe.gating import TopKGate
from zerodist.moe.layer import MOELayer

__all__ = ["MOELayer", "TUTEL_INSTALLED", "TopKGate", "_AllToAll", "_capacity", "_route_slots", "_sparse_decode",
           "_sparse_encode", "dist", "exp_selection_uniform_map", "gumbel_map", "gumbel_rsample",
           "multiplicative_jitter", "top1gating", "top2gating", "topkgating", "uniform_map"]
