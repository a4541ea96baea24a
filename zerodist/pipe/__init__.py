"""Pipeline parallelism.

Schedules are data (`schedule.py`): `build_schedule(name, num_ranks=..., num_microbatches=...)`
returns one list of `Action`s per pipe rank, and `schedule_checks.py` proves a schedule complete,
causal and deadlock-free and measures its bubble and stashed activations, without processes.
"""

from zerodist.pipe.schedule import (
    SCHEDULE_NAMES,
    Action,
    Kind,
    Schedule,
    ScheduleArgumentError,
    add_communication,
    add_sharding,
    build_schedule,
    compute_order,
    format_schedule,
    forward_only,
    stage_to_rank,
)
from zerodist.pipe.schedule_checks import (
    Costs,
    DeadlockError,
    DependencyError,
    IncompleteScheduleError,
    MessageOrderError,
    PlacementError,
    ScheduleError,
    ShardingError,
    SimulationResult,
    TimedAction,
    UnmatchedMessageError,
    check_schedule,
    check_sharding,
    measure_timeline,
    message_counts,
    peak_gathered,
    simulate,
)

# The pipeline's module and executor (DeepSpeed's PipelineModule API), and its front door: the
# engine's batch runner (zerodist.engine.pipeline) runs what apply_pipeline made.
from zerodist.pipe.module import LayerSpec, PartitionError, PipelineModule, TiedLayerSpec
from zerodist.pipe.executor import PipelineError, PipelineExecutor
from zerodist.pipe.apply import PipelineSettings, PipelineState, apply_pipeline
# Splitting a model the user already wrote, keeping its names (torchtitan's way).
from zerodist.pipe.split import SplitError, SplitLayer, SplitPipelineModule, split_model
from zerodist.pipe.split_plans import SplitPlan, UnknownModelError, find_split_plan, token_cross_entropy

__all__ = [
    "LayerSpec", "PartitionError", "PipelineError", "PipelineExecutor", "PipelineModule", "TiedLayerSpec",
    "PipelineSettings", "PipelineState", "apply_pipeline",
    "SplitError", "SplitLayer", "SplitPipelineModule", "SplitPlan", "UnknownModelError", "find_split_plan",
    "split_model", "token_cross_entropy",
    "SCHEDULE_NAMES",
    "Action",
    "Costs",
    "DeadlockError",
    "DependencyError",
    "IncompleteScheduleError",
    "Kind",
    "MessageOrderError",
    "PlacementError",
    "Schedule",
    "ScheduleArgumentError",
    "ScheduleError",
    "ShardingError",
    "SimulationResult",
    "TimedAction",
    "UnmatchedMessageError",
    "add_communication",
    "add_sharding",
    "build_schedule",
    "check_schedule",
    "check_sharding",
    "compute_order",
    "format_schedule",
    "forward_only",
    "measure_timeline",
    "message_counts",
    "peak_gathered",
    "simulate",
    "stage_to_rank",
]
