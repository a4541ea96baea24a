"""``deepspeed.zero.Init`` and ``GatheredParameters`` when zerodist serves ``import deepspeed``: the
two names transformers' ZeRO-3 loading calls, given the outcome DeepSpeed gives it.

[Note: from_pretrained under the served zero.Init]
Under ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init(config_dict_or_path=...)``,
then initialises and loads it module by module inside ``GatheredParameters(params,
modifier_rank=0)`` with only rank 0 writing the values (``initialize_weights_zero3``,
``_load_state_dict_into_zero3_model``): DeepSpeed's partitioned parameters carry rank 0's values to
every rank when the block exits. zerodist's own ``zerodist.zero.Init`` builds on the meta device
and materialises the *initialisation* in ``initialize()``, where values copied in before would be
lost. Served to transformers, therefore:

- ``Init`` validates its keywords as zerodist's does, then builds eagerly on the CPU and cuts each
  module's parameters to this rank's shard as soon as the module is built (rank 0's values, as
  DeepSpeed broadcasts them): [Note: partitioned construction] in zerodist/zero/init_shards.py.
  ``enabled=False`` builds eagerly without cutting. A config dict whose ``"auto"`` values the
  Trainer has not filled yet is checked without them, as DeepSpeed's ``Init`` reads it: axolotl
  loads the model under a fresh ``HfTrainerDeepSpeedConfig`` of its template with only the batch
  sizes filled (``gradient_clipping``, ``fp16.enabled``, ``bf16.enabled`` still ``"auto"``); the
  Trainer fills them before ``initialize()``, which checks them.
- ``GatheredParameters`` gathers those shards, and with a ``modifier_rank`` cuts that rank's
  values again on exit; for the parameters an engine holds it is zerodist's; parameters built
  outside ``Init`` that no engine holds yet are, with a ``modifier_rank``, broadcast from it on exit
  (what DeepSpeed's partitioned parameters would have carried).
- ``initialize()`` adopts the shards module by module (``build_groups``), never holding the whole
  model on a rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.config.auto import drop_trainer_auto
from zerodist.pipe import PipelineModule
import zerodist.zero as _zero
from zerodist.zero import init_shards, registry

_ZeroGatheredParameters = _zero.GatheredParameters
_ZeroInit = _zero.Init


def Init(*args: Any, enabled: bool = True, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:  # noqa: N802
    """zerodist's ``Init`` keywords and checks; each module's parameters are cut to this rank's shard
    once it is built ([Note: from_pretrained under the served zero.Init])."""
    if len(args) > 7:  # DeepSpeed's order: module, data_parallel_group, mem_efficient_linear, remote_device,
        enabled = args[7]  # pin_memory, config_dict_or_path, config, enabled, dtype, mpu
        kwargs.update(zip(("dtype", "mpu"), args[8:]))
        args = args[:7]
    for name in ("config_dict_or_path", "config"):
        if isinstance(kwargs.get(name), Mapping):
            kwargs[name], pending = drop_trainer_auto(kwargs[name])
            if "fp16.enabled" in pending or "bf16.enabled" in pending:
                kwargs["dtype"] = None  # the precision is not decided yet: nothing to check a dtype against
    _ZeroInit(*args, **{**kwargs, "enabled": False})  # the keyword checks, before anything is built
    if not enabled:
        return contextlib.nullcontext()
    if not comm.is_initialized():
        comm.init_distributed()  # as DeepSpeed's Init does: the shards need the world
    return init_shards.partitioned_construction(refuse=_refused)


def _refused(obj: object) -> str | None:
    if isinstance(obj, PipelineModule):
        return ("deepspeed.zero.Init: a PipelineModule builds only its own stage's layers, so the ranks' "
                "parameters differ and cannot be partitioned at construction; build it outside the block "
                "(or with enabled=False): initialize() shards it by its ZeRO stage")
    return None


class GatheredParameters(_ZeroGatheredParameters):
    """zerodist's; with ``modifier_rank``, parameters no engine holds yet are broadcast from it on exit."""

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if not self.enabled or self.modifier_rank is None or exc[0] is not None:
            return
        loose = [p for p in self.params if isinstance(p, torch.Tensor) and not p.is_meta
                 and not registry._owners([p]) and init_shards.entry(p) is None]
        if loose and comm.get_world_size() > 1:
            with torch.no_grad():
                for param in loose:  # on the backend's device (NCCL moves CUDA tensors only)
                    values = param.detach().contiguous().to(comm.device_for_rank())
                    comm.broadcast(values, src=self.modifier_rank)
                    if values.data_ptr() != param.data_ptr():
                        param.data.copy_(values)
