"""Layer 5: ZeRO. Pure layout arithmetic, flat buffers, buckets, units, the sharded optimizer.

One design for every stage (docs/design/zero.md: stages are knobs): a stage only decides which
buffers are full or sharded and when gradients are reduced. The front door is `apply_zero`
(apply.py): one part of the model in, its `ZeroState` out; its `UnitRuntime` (runtime.py) holds
the verbs a schedule calls (`unshard`, `wait_unshard`, `reshard`, `reduce_gradients`).
"""

from zerodist.zero.apply import OptimizerRecipe, apply_zero
from zerodist.zero.bucket import Bucket, BucketState, GradSyncPlan
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.init_shards import register_external_parameter, unregister_external_parameter
from zerodist.zero.layout import FlatLayout, plan_layout
from zerodist.zero.optimizer import StepResult, ZeroOptimizer
from zerodist.zero.partition import Init
from zerodist.zero.reducer import GradReducer
from zerodist.zero.registry import GatheredParameters, full_shape, is_sharded
from zerodist.zero.runtime import UnitRuntime, UnitSettings
from zerodist.zero.settings import ZeroSettings
from zerodist.zero.sharded_access import ShardedParameterError
from zerodist.zero.state import ZeroState
from zerodist.zero.unit_checks import Stage3ControlFlowError, UnitControlFlowError
from zerodist.zero.units import Unit, UnitState

__all__ = ["Bucket", "BucketState", "FlatLayout", "FlatParamGroup", "GatheredParameters", "GradReducer", "GradSyncPlan",
           "Init", "OptimizerRecipe", "ShardedParameterError", "Stage3ControlFlowError", "StepResult", "Unit",
           "UnitControlFlowError", "UnitRuntime", "UnitSettings", "UnitState", "ZeroOptimizer", "ZeroSettings",
           "ZeroState", "apply_zero", "full_shape", "is_sharded", "plan_layout", "register_external_parameter",
           "unregister_external_parameter"]
