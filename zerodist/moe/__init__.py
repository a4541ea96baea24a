"""Layer 5: mixture of experts with expert parallelism (DeepSpeed's `deepspeed.moe` API).

- `zerodist.moe.layer.MoE`: the layer (gate, dispatch, experts, combine);
- `zerodist.moe.gating`: top-k routing with capacity, pure;
- `zerodist.moe.dispatch`: capacity and dropless all-to-all dispatch through `zerodist.comm`;
- `zerodist.moe.experts.Experts`: the local experts, declared as the `EXPERT` domain;
- `zerodist.moe.utils`: `is_moe_param`, `split_params_into_different_moe_groups_for_optimizer`.
"""

from zerodist.moe.layer import MoE, MoEShapeMismatchError, RoutingStats
from zerodist.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "MoEShapeMismatchError", "RoutingStats", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]
