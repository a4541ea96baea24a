"""Layer 5: ZeRO. Pure layout arithmetic, flat buffers, buckets, the sharded optimizer.

One design for every stage (DESIGN.md: stages are knobs): a stage only decides which buffers
are full or sharded and when gradients are reduced.
"""

from zerodist.zero.bucket import Bucket, BucketState, GradSyncPlan
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.layout import FlatLayout, plan_layout
from zerodist.zero.optimizer import StepResult, ZeroOptimizer
from zerodist.zero.partition import Init
from zerodist.zero.reducer import GradReducer
from zerodist.zero.sharded_access import ShardedParameterError
from zerodist.zero.stage3 import GatheredParameters, Stage3ControlFlowError, full_shape, is_sharded

__all__ = ["Bucket", "BucketState", "FlatLayout", "FlatParamGroup", "GatheredParameters", "GradReducer", "GradSyncPlan",
           "Init", "ShardedParameterError", "Stage3ControlFlowError", "StepResult", "ZeroOptimizer", "full_shape",
           "is_sharded", "plan_layout"]
