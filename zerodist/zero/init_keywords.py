"""`deepspeed.zero.Init`'s keywords: those that ask for nothing zerodist lacks are accepted, the rest
refused with the reason, before any model is built.

zerodist's `Init` builds on the meta device and `initialize()` materialises and shards the
model with the training config's dtype and the rank's device, so the keywords that choose a
dtype, a device or a group at construction time can only agree with what `initialize()` will do.
"""

from __future__ import annotations

from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.config import Config

# Keywords DeepSpeed's Init takes whose default is the only value that asks for nothing new.
_DEFAULT_ONLY = {
    "zero_param_parallel_group": (None, "hierarchical (hpZ) partitioning is not implemented"),
    "zero_quantized_weights": (False, "quantized weights are not implemented"),
    "zero_quantized_nontrainable_weights": (False, "quantized weights are not implemented"),
    "sequence_data_parallel_group": (None, "sequence parallelism is not implemented"),
    "param_swapper": (None, "NVMe parameter swapping is not implemented"),
}
_TRAINING_DTYPE_NAMES = {torch.float32: "fp32 (neither fp16 nor bf16 enabled)", torch.float16: "fp16.enabled",
                         torch.bfloat16: "bf16.enabled"}


def check_init_keywords(*, module: Any, data_parallel_group: Group, remote_device: Any, pin_memory: bool,
                        config_dict_or_path: Any, config: Any, dtype: Any, mpu: Any, extra: dict[str, Any]) -> None:
    """Raise ValueError (TypeError for a name DeepSpeed's Init does not take) naming the keyword."""
    unknown = sorted(set(extra) - set(_DEFAULT_ONLY) - {"tensor_overrides", "mem_efficient_linear"})
    if unknown:
        raise TypeError(f"zero.Init() got unexpected keyword argument(s) {', '.join(unknown)}")
    for name, value in extra.items():
        if name in _DEFAULT_ONLY and value != _DEFAULT_ONLY[name][0]:
            raise ValueError(f"zero.Init({name}={value!r}): {_DEFAULT_ONLY[name][1]}; remove it")
    if module is not None:
        raise ValueError("zero.Init(module=...): a model built outside Init is partitioned by initialize() itself "
                         "at ZeRO stage 3; pass it to initialize(model=...) and drop zero.Init")
    if mpu is not None:
        raise ValueError("zero.Init(mpu=...): zerodist takes no model-parallel unit; remove mpu")
    if remote_device not in (None, "none"):
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): parameter offload is not implemented; "
                         "the model is materialised on each rank's device by initialize(); remove remote_device")
    if pin_memory:
        raise ValueError("zero.Init(pin_memory=True): pinned memory is for CPU offload, which is not implemented; "
                         "remove pin_memory")
    if data_parallel_group is not None and data_parallel_group is not comm.get_world_group():
        raise ValueError("zero.Init(data_parallel_group=...): zerodist shards over the data-parallel group of the "
                         "launcher's world (zerodist.comm.Topology); only the world group is accepted")
    _check_dtype(dtype, _training_config(config_dict_or_path, config))


def _training_config(config_dict_or_path: Any, config: Any) -> Config | None:
    if config is not None and config_dict_or_path is not None:
        raise ValueError("zero.Init(): config is the old name of config_dict_or_path; give one of them")
    source = config_dict_or_path if config_dict_or_path is not None else config
    # Validated now, so a bad config fails before a large model is built, not after.
    return None if source is None else Config.load(source)


def _check_dtype(dtype: Any, config: Config | None) -> None:
    if dtype is None:
        return
    if dtype not in _TRAINING_DTYPE_NAMES:
        raise ValueError(f"zero.Init(dtype={dtype}): parameters train in torch.float32, torch.float16 or "
                         "torch.bfloat16")
    if config is None:
        return  # initialize() gives the parameters the dtype of the config it is given
    trained = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else torch.float32
    if dtype != trained:
        raise ValueError(f"zero.Init(dtype={dtype}) but its config trains in {trained} "
                         f"({_TRAINING_DTYPE_NAMES[trained]}); the parameters take the config's dtype in "
                         "initialize(), so drop dtype or make them agree")
