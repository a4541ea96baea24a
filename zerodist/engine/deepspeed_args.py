"""DeepSpeed's command-line arguments and `initialize()` keywords, with DeepSpeed's meanings.

    parser = deepspeed.add_config_arguments(parser)        # --deepspeed, --deepspeed_config
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=params)

`initialize()` takes the config from `args.deepspeed_config` when `config` is None, and
`config_params` is the old name of `config`. Keywords asking for something zerodist does not do
(`mpu`, `mesh_param`) are refused here, before any process group exists, with the reason.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import zerodist.comm as comm
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
    if mpu is not None:
        raise ValueError("initialize(mpu=...): zerodist builds its process groups from the launcher's world "
                         "(zerodist.comm.Topology) and takes no model-parallel unit; remove mpu")
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...): zerodist builds its device mesh from the launcher's world "
                         "(zerodist.comm.Topology); remove mesh_param")
    comm.use_default_port(distributed_port)
    if dist_init_required is False and not comm.is_initialized():
        raise RuntimeError("initialize(dist_init_required=False) but no process group exists: call "
                           "deepspeed.init_distributed() first, or leave dist_init_required as None")
    if config is None and config_params is not None:
        config = config_params
    elif config is not None and config_params is not None:
        log_rank0(logger, "initialize(): both config and config_params are given; using config, as DeepSpeed does")
    return _config_from_args(args, config)


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
