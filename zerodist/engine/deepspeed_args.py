"""DeepSpeed's command-line arguments and `initialize()` keywords, with DeepSpeed's meanings.

    parser = deepspeed.add_config_arguments(parser)        # --deepspeed, --deepspeed_config
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=params)

`initialize()` takes the config from `args.deepspeed_config` when `config` is None, and
`config_params` is the old name of `config`.

[Note: DeepSpeed's manual sequence parallelism] DeepSpeed makes a sequence-parallel mesh three ways,
and then only makes the groups: the script shards its sequence and calls the exchanges itself on
`engine.seq_parallel_group` (`DistributedAttention(attn, group)`, `_SeqAllToAll.apply(...)`). Those
are `initialize(mpu=parallel_state_sp)` after `initialize_sequence_parallel(sp)`, `initialize(
mesh_param=(dp, sp))`, and a config with both `data_parallel_size` and `sequence_parallel_size`.
Each becomes here the config's `sequence_parallel_size: sp` with `zerodist.sequence_parallel.method:
"manual"`: the engine's topology gets its `sequence` axis (consecutive ranks share a sequence
group, DeepSpeed's mesh order), ZeRO shards and reduces over data x sequence and divides by the
data degree (DeepSpeed's), and nothing is done to the model or the data (zerodist/sequence/apply.py).
A `sequence_parallel_size` alone keeps zerodist's own meaning (the engine applies it). Any other
`mpu` (a Megatron model-parallel unit) is refused, before any process group exists, with the reason.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.config import Config
from zerodist.comm.init import read_launch_env
from zerodist.config.source import read_source
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

DEFAULT_PORT = comm.DEFAULT_PORT  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to `parser`: `--deepspeed` (a flag for the script's own use;
    it changes nothing in the library), `--deepspeed_config PATH`, and their deprecated
    `--deepscale` / `--deepscale_config` spellings. Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the library)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the library)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def resolve_initialize_arguments(*, args: Any, model: Any, config: Any, config_params: Any, mpu: Any,
                                 mesh_param: Any, distributed_port: int, dist_init_required: bool | None) -> Any:
    """Check DeepSpeed's `initialize()` keywords and return the config source to load (None: defaults)."""
    if model is None:
        if isinstance(args, torch.nn.Module):
            raise TypeError("initialize(): the first positional argument is `args` (DeepSpeed's order) and got a "
                            f"{type(args).__name__}; pass the model as initialize(model=...)")
        raise TypeError("initialize() requires a model: initialize(model=...)")
    comm.use_default_port(distributed_port)
    if dist_init_required is False and not comm.is_initialized():
        raise RuntimeError("initialize(dist_init_required=False) but no process group exists: call "
                           "deepspeed.init_distributed() first, or leave dist_init_required as None")
    if config is None and config_params is not None:
        config = config_params
    elif config is not None and config_params is not None:
        log_rank0(logger, "initialize(): both config and config_params are given; using config, as DeepSpeed does")
    return manual_sequence_config(_config_from_args(args, config), mpu, mesh_param)


def manual_sequence_config(config: Any, mpu: Any, mesh_param: Any) -> Any:
    """The config with DeepSpeed's manual sequence-parallel mesh in zerodist's keys ([Note: DeepSpeed's
    manual sequence parallelism]); `config` as it was when none is asked for."""
    if isinstance(config, Config):
        if mpu is None and mesh_param is None:
            return config  # a validated Config has no data_parallel_size
        raw: dict[str, Any] = config.model_dump(exclude_unset=True)
    elif config is None:
        raw = {}
    elif isinstance(config, (str, os.PathLike)) and not Path(config).is_file() and mpu is None and mesh_param is None:
        return config  # Config.load names what is wrong with it
    else:
        raw, _ = read_source(config)
    mesh = _mesh(raw, mpu, mesh_param)
    if mesh is None:
        return config
    data, sequence = mesh
    world = comm.get_world_size() if comm.is_initialized() else read_launch_env(need_master=False).world_size
    if data * sequence != world:
        raise ValueError(f"initialize(): DeepSpeed's sequence-parallel mesh is data {data} x sequence {sequence} = "
                         f"{data * sequence} ranks, but the world has {world}; make the product the world size")
    raw = {key: value for key, value in raw.items() if key != "data_parallel_size"}
    raw["sequence_parallel_size"] = sequence
    section = dict(raw.get("zerodist", {}))
    section["sequence_parallel"] = {**section.get("sequence_parallel", {}), "method": "manual"}
    raw["zerodist"] = section
    return raw


def _mesh(raw: Mapping[str, Any], mpu: Any, mesh_param: Any) -> tuple[int, int] | None:
    """(data, sequence) degrees of DeepSpeed's manual mesh, None when none is asked for."""
    if mpu is not None:
        if not hasattr(mpu, "get_sequence_parallel_world_size") or hasattr(mpu, "get_data_parallel_world_size"):
            raise ValueError("initialize(mpu=...): zerodist builds its process groups from the launcher's world "
                             "(zerodist.comm.Topology) and takes no model-parallel unit; remove mpu (a "
                             "sequence-parallel unit, deepspeed.runtime.sequence_parallel.parallel_state_sp, is "
                             "taken; tensor parallelism is the config's \"tensor_parallel\": {\"autotp_size\": t})")
        sequence = int(mpu.get_sequence_parallel_world_size())
        ranks: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(ranks, int(mpu.get_sequence_parallel_rank()))
        if ranks != [rank % sequence for rank in range(len(ranks))]:
            raise ValueError(f"initialize(mpu=...): the unit's sequence ranks by global rank are {ranks}; zerodist's "
                             f"sequence groups are consecutive ranks (DeepSpeed's initialize_sequence_parallel)")
        return comm.get_world_size() // sequence, sequence
    if mesh_param is not None:
        if not (isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
                and all(isinstance(size, int) and size >= 1 for size in mesh_param)):
            raise ValueError(f"initialize(mesh_param={mesh_param!r}): DeepSpeed's mesh_param is (data_parallel_size, "
                             "sequence_parallel_size), two positive ints")
        return int(mesh_param[0]), int(mesh_param[1])
    if "data_parallel_size" in raw:
        if "sequence_parallel_size" not in raw:
            raise ValueError("config 'data_parallel_size' without 'sequence_parallel_size': DeepSpeed reads the two "
                             "together, for its sequence-parallel mesh; zerodist derives the data degree from the "
                             "world, so remove 'data_parallel_size' (or add 'sequence_parallel_size')")
        return int(raw["data_parallel_size"]), int(raw["sequence_parallel_size"])
    return None


def _config_from_args(args: Any, config: Any) -> Any:
    legacy = getattr(args, "deepscale_config", None)
    if legacy is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("initialize(args=...): both --deepscale_config and --deepspeed_config are set; "
                             "keep --deepspeed_config")
        log_rank0(logger, "--deepscale_config is deprecated; use --deepspeed_config")
        from_args = legacy
    else:
        from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is not None:
        raise ValueError(f"initialize(): the config is given twice, by --deepspeed_config ({from_args}) and by "
                         "initialize(config=...); keep one")
    return from_args if from_args is not None else config


def update_args_local_rank(args: Any, local_rank: int) -> None:
    """DeepSpeed sets `args.local_rank` to the launcher's local rank when `args` has one, and scripts
    read it after `initialize()`; the namespace is the script's argument object, not a model."""
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank
