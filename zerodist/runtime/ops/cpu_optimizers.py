"""``deepspeed.ops.adam`` / ``deepspeed.ops.adagrad`` under ``import deepspeed`` served by zerodist: the
host optimizers accelerate puts in place of the Trainer's own when a config offloads the optimizer.

[Note: DeepSpeed's CPU optimizers, served as torch's]
accelerate's DeepSpeed path (``Accelerator._prepare_deepspeed``) replaces the Trainer's torch optimizer
whenever the config says ``offload_optimizer.device`` other than ``none`` (and ``zero_force_ds_cpu_optimizer``
is unset or true), as axolotl's ``zero2.json`` and LLaMA-Factory's ``ds_z2_offload_config.json`` do:
``map_pytorch_optim_to_deepspeed`` builds ``DeepSpeedCPUAdam(optimizer.param_groups, lr=..., weight_decay=...,
adamw_mode=isinstance(optimizer, AdamW))`` (``DeepSpeedCPUAdagrad`` for a torch ``Adagrad``) and hands that
to ``deepspeed.initialize``. Under DeepSpeed those are its C++ kernels. zerodist steps torch optimizers
over its flat shards (host offload too: docs/offload.md), so the served names build the torch optimizer
with the same update: ``DeepSpeedCPUAdam`` is ``torch.optim.AdamW`` (``adamw_mode=True``, DeepSpeed's
default: decoupled weight decay) or ``torch.optim.Adam`` (``adamw_mode=False``: L2 decay), and
``DeepSpeedCPUAdagrad`` is ``torch.optim.Adagrad``, each over the groups given (their betas, eps and
per-group options kept, as DeepSpeed reads them from the groups). The engine then takes that instance
as it takes any torch optimizer (``engine/optimizers.py``). ``amsgrad=True`` for Adam (the argument or a
group's ``'amsgrad'``) is refused as DeepSpeed refuses it ("DeepSpeedCPUAdam does not support the AMSGrad
variant", its ``add_param_group``); ``bias_correction=False`` (the argument or a group's, which DeepSpeed's
kernel reads per group) has no torch counterpart and is refused by name. Adagrad's ``amsgrad`` is taken
and ignored, as DeepSpeed's Adagrad ignores it. ``fp32_optimizer_states`` is accepted (the state
follows the parameters zerodist steps: fp32, or the fp32 masters under bf16/fp16). ``deepspeed.ops.adam`` and
``deepspeed.ops.adagrad`` are served by ``adam.py`` / ``adagrad.py`` (each with DeepSpeed's one class); their
other names (``FusedAdam``, ...) and the other kernels under ``deepspeed.ops`` (``DeepSpeedCPULion``, ...)
are refused by name (``not_served`` below; the finder in ``integrations/as_deepspeed.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerodist.utils import get_logger, log_rank0

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "not_served"]

logger = get_logger(__name__)


class DeepSpeedCPUAdam:
    """DeepSpeed's signature; builds and returns ``torch.optim.AdamW`` (``adamw_mode=True``) or
    ``torch.optim.Adam`` (``adamw_mode=False``) over the same groups."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # type: ignore[misc]
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True
                ) -> torch.optim.Optimizer:
        model_params = list(model_params)
        groups = [g for g in model_params if isinstance(g, dict)]
        if amsgrad or any(g.get("amsgrad", amsgrad) for g in groups):
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant (DeepSpeed raises this too; "
                               "amsgrad=True, as the argument or a parameter group's 'amsgrad'); use amsgrad=False")
        if not bias_correction or not all(g.get("bias_correction", bias_correction) for g in groups):
            raise ValueError("DeepSpeedCPUAdam(bias_correction=False), as the argument or a parameter group's "
                             "'bias_correction': zerodist serves DeepSpeed's CPU Adam as torch.optim.Adam/AdamW, "
                             "which always corrects the bias; use bias_correction=True")
        torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        optimizer = torch_class(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        _log_served("DeepSpeedCPUAdam", torch_class)
        return optimizer


class DeepSpeedCPUAdagrad:
    """DeepSpeed's signature; builds and returns ``torch.optim.Adagrad`` over the same groups.
    ``amsgrad`` is taken and ignored, as DeepSpeed's Adagrad ignores it (it stores it and never reads it).
    ``adamw_mode`` is taken and means nothing: accelerate passes it (``adamw_mode=False``) to this class
    too, which DeepSpeed's own class refuses with a ``TypeError``."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,  # type: ignore[misc]
                weight_decay: float = 0.0, amsgrad: bool = False, fp32_optimizer_states: bool = True,
                adamw_mode: bool = False) -> torch.optim.Optimizer:
        optimizer = torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        _log_served("DeepSpeedCPUAdagrad", torch.optim.Adagrad)
        return optimizer


def _log_served(name: str, torch_class: type) -> None:
    log_rank0(logger, "%s (DeepSpeed's CPU kernel, asked for by the offload_optimizer section) is served as "
              "torch.optim.%s over the same parameter groups; zerodist steps it over its shards", name,
              torch_class.__name__)


def not_served(module: str, name: str, deepspeed_names: frozenset[str], served: str) -> Exception:
    """The error for `module.name` under the switch (for a served module's `__getattr__`): an ImportError for
    a name DeepSpeed's module has (so that `from deepspeed.ops.adam import FusedAdam` says why; an
    AttributeError there would become a bare "cannot import name"), an AttributeError for any other."""
    if name in deepspeed_names:
        return ImportError(f"cannot import name {name!r} from {module!r}: `import deepspeed` is served by zerodist "
                           f"here (zerodist run --as-deepspeed), which does not provide DeepSpeed's kernels; it "
                           f"serves {served} as torch's optimizer; use a torch optimizer (the config's \"optimizer\" "
                           "section, or the Trainer's own)", name=module)
    return AttributeError(f"module {module!r} has no attribute {name!r} (served by zerodist: only {served})")
