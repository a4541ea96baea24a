"""Layer 6: checks and tools that turn distributed "mysteries" into numbers and named errors.

- `reduce_loss`: the loss of the global batch (mean over ranks, token-weighted).
- `StepTimer` / `straggler_report`: which rank is slow.
- `estimate_memory` / `estimate_all_stages`: per-rank bytes under each ZeRO stage (pure).
- `check_gradient_sync` / `GradSyncWatch` / `check_weight_sync`: replicas that drifted apart.
- `NanHunter`: the first NaN/Inf (rank, module output, loss or parameter gradient).
- `memory_report` / `LeakWatch` / `estimate_for_engine`: memory per rank, steady growth.
- `SamplerWatch`: an epoch that repeats the previous epoch's order (a forgotten set_epoch).

The collective desync guard lives in `zerodist.comm.guard` (it sits under every collective);
it is re-exported here for discovery.
"""

from zerodist.comm.guard import (
    CollectiveMismatchError,
    collective_guard,
    disable_collective_guard,
    enable_collective_guard,
)
from zerodist.debug.estimate import MemoryEstimate, estimate_all_stages, estimate_memory, parse_count
from zerodist.debug.loss import reduce_loss
from zerodist.debug.memory import (LeakWatch, MemoryMonitor, MemoryReport, estimate_for_engine, heap_in_use,
                                   memory_report, padded_num_params)
from zerodist.debug.nan import NanHunter, NonFiniteError
from zerodist.debug.sampler import RepeatedEpochError, SamplerWatch
from zerodist.debug.straggler import RankStepTimes, StepTimer, StragglerReport, straggler_report
from zerodist.debug.sync import GradSyncWatch, check_gradient_sync, check_weight_sync
from zerodist.debug.sync_report import GradientSyncError, ParamSync, SyncError, SyncReport, WeightSyncError

__all__ = [
    "CollectiveMismatchError", "GradSyncWatch", "GradientSyncError", "LeakWatch", "MemoryEstimate", "MemoryMonitor",
    "MemoryReport", "NanHunter", "NonFiniteError", "ParamSync", "RankStepTimes", "RepeatedEpochError",
    "SamplerWatch", "StepTimer", "StragglerReport", "SyncError", "SyncReport", "WeightSyncError",
    "check_gradient_sync", "check_weight_sync", "collective_guard", "disable_collective_guard",
    "enable_collective_guard", "estimate_all_stages", "estimate_for_engine", "estimate_memory", "heap_in_use",
    "memory_report", "padded_num_params", "parse_count", "reduce_loss", "straggler_report",
]
