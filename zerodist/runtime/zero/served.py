"""``deepspeed.zero.Init`` and ``GatheredParameters`` when zerodist serves ``import deepspeed``: the
two names transformers' ZeRO-3 loading calls, given the outcome DeepSpeed gives it.

[Note: from_pretrained under the served zero.Init]
Under ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init(config_dict_or_path=...)``,
then loads the checkpoint module by module inside ``GatheredParameters(params, modifier_rank=0)``
with only rank 0 copying the values in (``_load_state_dict_into_zero3_model``; the same for
``initialize_weights_zero3``): DeepSpeed's partitioned parameters carry rank 0's values to every
rank when the block exits. zerodist's ``Init`` builds on the meta device and materialises the
*initialisation* later, in ``initialize()``, so values copied in before that would be lost. Served
to transformers, therefore:

- ``Init`` validates its keywords as zerodist's does, then builds eagerly (``initialize()``
  shards the built model: no construction-time memory saving, the same values). A config dict
  whose ``"auto"`` values the Trainer has not filled yet is checked without them, as DeepSpeed's
  ``Init`` reads it: axolotl loads the model under a fresh ``HfTrainerDeepSpeedConfig`` of its
  template with only the batch sizes filled (``gradient_clipping``, ``fp16.enabled``,
  ``bf16.enabled`` still ``"auto"``); the Trainer fills them before ``initialize()``, which checks them;
- ``GatheredParameters`` with a ``modifier_rank`` also broadcasts, on exit, the parameters no engine
  holds yet from that rank (what DeepSpeed's partitioned parameters would have carried), and
  behaves as zerodist's for the parameters an engine holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.config.auto import drop_trainer_auto
import zerodist.zero as _zero
from zerodist.zero import registry

_ZeroGatheredParameters = _zero.GatheredParameters
_ZeroInit = _zero.Init


def Init(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:  # noqa: N802
    """zerodist's ``Init`` keywords and checks; the model is built eagerly ([Note: from_pretrained under the served zero.Init])."""
    kwargs["enabled"] = False
    for name in ("config_dict_or_path", "config"):
        if isinstance(kwargs.get(name), Mapping):
            kwargs[name], pending = drop_trainer_auto(kwargs[name])
            if "fp16.enabled" in pending or "bf16.enabled" in pending:
                kwargs["dtype"] = None  # the precision is not decided yet: nothing to check a dtype against
    return _ZeroInit(*args, **kwargs)


class GatheredParameters(_ZeroGatheredParameters):
    """zerodist's; with ``modifier_rank``, parameters no engine holds yet are broadcast from it on exit."""

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if not self.enabled or self.modifier_rank is None or exc[0] is not None:
            return
        loose = [p for p in self.params if isinstance(p, torch.Tensor) and not p.is_meta
                 and not registry._owners([p])]
        if loose and comm.get_world_size() > 1:
            with torch.no_grad():
                for param in loose:
                    comm.broadcast(param.data, src=self.modifier_rank)
