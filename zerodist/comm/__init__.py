"""Layer 3: the only code that calls torch.distributed.

Initialisation (`init_distributed`), collectives with torch.distributed's signatures, the
`Topology` of parallel axes, and the communication tracer (`trace`).
"""

from zerodist.comm.collectives import (
    CommHandle,
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    gather_object,
    reduce,
    reduce_scatter,
)
from zerodist.comm.errors import DistributedInitError, TopologyError
from zerodist.comm.init import (
    WorldInfo,
    device_for_rank,
    ensure_initialized,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from zerodist.comm.topology import Topology
from zerodist.comm.tracer import CollectiveRecord, OpSummary, Trace, bus_factor, trace

__all__ = [
    "CollectiveRecord", "CommHandle", "DistributedInitError", "OpSummary", "ProcessGroup", "ReduceOp",
    "Topology", "TopologyError", "Trace", "WorldInfo", "all_gather", "all_gather_object", "all_reduce",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "bus_factor", "device_for_rank",
    "ensure_initialized", "gather_object", "get_local_rank", "get_rank", "get_world_size",
    "init_distributed", "is_initialized", "reduce", "reduce_scatter", "trace",
]
