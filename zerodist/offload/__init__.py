"""Offload: optimizer state on the host or in swap files (DeepSpeed's ZeRO-Offload / ZeRO-Infinity keys).

A technique of layer 5 beside `zero/`, unaware of it: it wraps the torch optimizer the engine
builds over ZeRO's flat shards, whatever the stage. See docs/offload.md and
docs/design/offload.md.
"""

from zerodist.offload.errors import OffloadError, SwapChecksumError, SwapFileError, SwapPathError, SwapSpaceError
from zerodist.offload.host import HostOffloadedOptimizer, TransferCounters, host_offloaded
from zerodist.offload.optimizer import StreamSettings, SwappedOptimizer, swapped
from zerodist.offload.setup import OffloadSettings, close_offload, offloaded_build, open_swap_directory
from zerodist.offload.subgroups import ALIGN, Piece, SubGroup, plan_subgroups
from zerodist.offload.swap_files import SwapCounters, SwapDirectory

__all__ = [
    "ALIGN", "HostOffloadedOptimizer", "OffloadError", "OffloadSettings", "Piece", "StreamSettings", "SubGroup", "SwapCounters",
    "SwapChecksumError", "SwapDirectory", "SwapFileError", "SwapPathError", "SwapSpaceError", "SwappedOptimizer", "TransferCounters", "close_offload",
    "host_offloaded",
    "offloaded_build", "open_swap_directory", "plan_subgroups", "swapped",
]
