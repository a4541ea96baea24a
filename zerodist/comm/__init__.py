"""Layer 3: the only code that calls torch.distributed.

Initialisation (`init_distributed`), collectives with torch.distributed's signatures, the
`Topology` of parallel axes, the placements techniques declare for their parameters (`domains`)
and the slice arithmetic that reads them (`slices`), the communication tracer (`trace`), the
blocked-time meter (`measure_blocked`), the hang watchdog (`set_hang_warning`,
`CollectiveTimeoutError`: watchdog.py) and the desync guard (`enable_collective_guard`, on for
any program with `ZERODIST_COLLECTIVE_GUARD=1`).
`init_distributed`, `all_gather`, `reduce_scatter` and the `get_*` helpers also take
`deepspeed.comm`'s signatures (deepspeed_names.py), so `from deepspeed import comm` code runs.
"""

from zerodist.comm.collectives import (
    CommHandle,
    Group,
    ProcessGroup,
    ReduceOp,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    gather_object,
    reduce,
)

# DeepSpeed's names and signatures; the flat-tensor forms of all_gather / reduce_scatter still work.
from zerodist.comm.deepspeed_names import (
    DEFAULT_PORT,
    all_gather,
    all_gather_into_tensor,
    allgather_fn,
    get_all_ranks_from_group,
    get_global_rank,
    get_world_group,
    has_all_gather_into_tensor,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    init_distributed,
    is_available,
    new_group,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    use_default_port,
)
from zerodist.comm.errors import DistributedInitError, TopologyError
from zerodist.comm.exchange import ExchangeTimeoutError, exchange_with_deadline

# Importing the guard turns it on when ZERODIST_COLLECTIVE_GUARD=1, for any program.
from zerodist.comm.guard import (
    CollectiveMismatchError,
    collective_guard,
    disable_collective_guard,
    enable_collective_guard,
)
from zerodist.comm.init import (
    WorldInfo,
    device_for_rank,
    ensure_initialized,
    get_local_rank,
    get_rank,
    get_world_size,
    is_initialized,
)
from zerodist.comm.watchdog import CollectiveError, CollectiveTimeoutError, set_hang_warning
from zerodist.comm.nodes import simulate_nodes
from zerodist.comm.topology import DENSE, EXPERT, TENSOR_SLICE, Domain, Topology
from zerodist.comm.tracer import BlockedTime, CollectiveRecord, OpSummary, Trace, bus_factor, measure_blocked, trace

__all__ = [
    "BlockedTime", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "CollectiveRecord", "CommHandle", "DistributedInitError", "ExchangeTimeoutError", "OpSummary",
    "DENSE", "Domain", "EXPERT", "ProcessGroup", "ReduceOp", "TENSOR_SLICE", "Topology", "TopologyError", "Trace", "WorldInfo", "all_gather",
    "all_gather_object", "all_reduce", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
    "bus_factor", "collective_guard", "device_for_rank", "disable_collective_guard", "enable_collective_guard",
    "ensure_initialized", "exchange_with_deadline", "gather_object", "get_global_rank", "get_local_rank", "get_rank", "get_world_size", "init_distributed",
    "is_initialized", "measure_blocked", "reduce", "reduce_scatter", "set_hang_warning", "simulate_nodes", "trace",
    # deepspeed.comm's names (deepspeed_names.py)
    "DEFAULT_PORT", "all_gather_into_tensor", "allgather_fn", "get_all_ranks_from_group", "get_world_group",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce", "is_available", "new_group",
    "reduce_scatter_fn", "reduce_scatter_tensor", "use_default_port",
]
