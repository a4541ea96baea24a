"""`deepspeed.comm`'s names and signatures where they differ from torch.distributed's.

A script that does `from deepspeed import comm as dist` under `import zerodist as deepspeed`
gets `zerodist.comm`; these functions give it DeepSpeed's spellings. Each one goes through
zerodist's collectives (initialised on first use, traced, guarded), never around them.

Two of DeepSpeed's names take a list where zerodist's take one flat tensor:
`all_gather(tensor_list, tensor)` and `reduce_scatter(output, input_list)`. Both forms are
accepted (a list selects DeepSpeed's); the list is packed into one flat tensor, so the
collective that runs is still the single all-gather / reduce-scatter the tracer shows.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerodist.comm import collectives
from zerodist.comm.collectives import CommHandle, Group, ReduceOp
from zerodist.comm.errors import DistributedInitError
from zerodist.comm.init import WorldInfo, ensure_initialized, is_initialized
from zerodist.comm.init import get_global_rank as _get_global_rank
from zerodist.comm.init import init_distributed as _init_distributed

# DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT, and zerodist's default for SLURM / Open MPI launches.
DEFAULT_PORT = 29500


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: float | datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> WorldInfo:
    """DeepSpeed's `init_distributed`: join (or adopt) the default process group. Idempotent.

    The launcher's variables (torchrun, SLURM, Open MPI: read whatever `auto_mpi_discovery`
    says) give rank and world size; `rank` / `world_size`, when given, must agree with them.
    `timeout` None means `ZERODIST_TIMEOUT`, else 600 s. Returns how this process joined
    (DeepSpeed returns None)."""
    del auto_mpi_discovery, verbose  # Open MPI's variables are always read; logging is zerodist's own
    if config is not None:
        raise DistributedInitError("init_distributed(config=...): the communication settings (comms_logger) "
                                   "are read from the config given to initialize(); remove config here")
    if dist_init_required is False and not is_initialized():
        raise DistributedInitError("init_distributed(dist_init_required=False) but no process group exists; "
                                   "leave dist_init_required as None to create one")
    use_default_port(distributed_port)
    info = _init_distributed(dist_backend, timeout=timeout, init_method=init_method)
    for name, asked, actual in (("rank", rank, info.rank), ("world_size", world_size, info.world_size)):
        if asked != -1 and asked != actual:
            raise DistributedInitError(f"init_distributed({name}={asked}) but the launch gives {name} {actual} "
                                       f"({info.source}); drop the argument or fix the launch")
    return info


def use_default_port(distributed_port: int) -> None:
    """DeepSpeed uses `distributed_port` as rank 0's port when the launcher set none (MPI and SLURM
    launches); torchrun always sets MASTER_PORT, which then wins, as in DeepSpeed."""
    if isinstance(distributed_port, bool) or not isinstance(distributed_port, int) or not 0 < distributed_port < 65536:
        raise DistributedInitError(f"distributed_port must be a TCP port (1-65535), got {distributed_port!r}")
    if distributed_port != DEFAULT_PORT and "MASTER_PORT" not in os.environ and not is_initialized():
        os.environ["MASTER_PORT"] = str(distributed_port)


def is_available() -> bool:
    return dist.is_available()


def get_world_group() -> Any:
    """The default (world) process group."""
    ensure_initialized()
    return dist.group.WORLD


def get_global_rank(group: Group = None, group_rank: int = 0) -> int:
    """The global rank of member `group_rank` of `group` (DeepSpeed's defaults: the world, member 0)."""
    return _get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Group = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    ensure_initialized()
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def new_group(ranks: Sequence[int]) -> Any:
    """A process group of the given global ranks (every rank must call it, as in torch)."""
    ensure_initialized()
    return dist.new_group(list(ranks))


def has_all_gather_into_tensor() -> bool:
    return True  # zerodist's all_gather is the flat (into-tensor) collective


def has_reduce_scatter_tensor() -> bool:
    return True


def all_gather(tensor_list: torch.Tensor | list[torch.Tensor], tensor: torch.Tensor, group: Group = None,
               async_op: bool = False) -> CommHandle:
    """Every rank's `tensor`, concatenated: into the flat tensor `tensor_list` (zerodist's form, group
    size x `tensor.numel()` elements), or one entry per rank of the list `tensor_list` (DeepSpeed's
    and torch's form)."""
    if isinstance(tensor_list, torch.Tensor):
        return collectives.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    outputs = _check_list("all_gather", tensor_list, tensor, group)
    flat = torch.empty(len(outputs) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    handle = collectives.all_gather(flat, tensor.contiguous().view(-1), group=group, async_op=async_op)

    def unpack() -> None:
        for rank, output in enumerate(outputs):
            output.copy_(flat[rank * tensor.numel():(rank + 1) * tensor.numel()].view_as(output))

    return CommHandle(None, handle if async_op else None, unpack)


def reduce_scatter(output: torch.Tensor, input_list: torch.Tensor | list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Group = None, async_op: bool = False) -> CommHandle:
    """Reduce over the group and keep this rank's part in `output`: the flat tensor `input_list`
    (zerodist's form) or the list of one tensor per rank (DeepSpeed's and torch's form)."""
    if isinstance(input_list, torch.Tensor):
        return collectives.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    inputs = _check_list("reduce_scatter", input_list, output, group)
    flat = torch.cat([t.contiguous().view(-1) for t in inputs])
    return collectives.reduce_scatter(output, flat, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Group = None,
                           async_op: bool = False) -> CommHandle:
    return collectives.all_gather(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None,
                 async_op: bool = False) -> CommHandle:
    return collectives.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Group = None, async_op: bool = False) -> CommHandle:
    return collectives.reduce_scatter(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Group = None, async_op: bool = False) -> CommHandle:
    return collectives.reduce_scatter(output_tensor, tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None) -> CommHandle:
    """DeepSpeed's all-reduce for inference kernels; here the ordinary, synchronous all-reduce."""
    return collectives.all_reduce(tensor, op=op, group=group)


def _check_list(op: str, tensors: Sequence[torch.Tensor], like: torch.Tensor, group: Group) -> list[torch.Tensor]:
    ensure_initialized()
    size = dist.get_world_size(group)
    tensors = list(tensors)
    if len(tensors) != size:
        raise ValueError(f"{op}: the list has {len(tensors)} tensors; it needs one per rank of the group ({size})")
    for index, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(f"{op}: list entry {index} is {t.dtype} with {t.numel()} elements; every entry must "
                             f"match the other tensor ({like.dtype}, {like.numel()} elements)")
    return tensors
