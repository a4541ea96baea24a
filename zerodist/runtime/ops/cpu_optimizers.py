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
as it takes any torch optimizer (``engine/optimizers.py``). What has no torch counterpart is refused by
name (``bias_correction=False``, Adagrad's ``amsgrad``); ``fp32_optimizer_states`` is accepted (the state
follows the parameters zerodist steps: fp32, or the fp32 masters under bf16/fp16). Other kernels under
``deepspeed.ops`` (``FusedAdam``, ``DeepSpeedCPULion``, ...) stay refused by the finder
(``integrations/as_deepspeed.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerodist.utils import get_logger, log_rank0

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam"]
__path__: list[str] = []  # `deepspeed.ops.adam`, `deepspeed.ops.adagrad` are submodules in DeepSpeed

logger = get_logger(__name__)


class DeepSpeedCPUAdam:
    """DeepSpeed's signature; builds and returns ``torch.optim.AdamW`` (``adamw_mode=True``) or
    ``torch.optim.Adam`` (``adamw_mode=False``) over the same groups."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # type: ignore[misc]
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True
                ) -> torch.optim.Optimizer:
        if not bias_correction:
            raise ValueError("DeepSpeedCPUAdam(bias_correction=False): zerodist serves DeepSpeed's CPU Adam as "
                             "torch.optim.Adam/AdamW, which always corrects the bias; use bias_correction=True")
        torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        optimizer = torch_class(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        _log_served("DeepSpeedCPUAdam", torch_class)
        return optimizer


class DeepSpeedCPUAdagrad:
    """DeepSpeed's signature; builds and returns ``torch.optim.Adagrad`` over the same groups.
    ``adamw_mode`` is taken and means nothing: accelerate passes it (``adamw_mode=False``) to this class
    too, which DeepSpeed's own class refuses with a ``TypeError``."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,  # type: ignore[misc]
                weight_decay: float = 0.0, amsgrad: bool = False, fp32_optimizer_states: bool = True,
                adamw_mode: bool = False) -> torch.optim.Optimizer:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant (DeepSpeed refuses "
                             "it too); use amsgrad=False")
        optimizer = torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        _log_served("DeepSpeedCPUAdagrad", torch.optim.Adagrad)
        return optimizer


def _log_served(name: str, torch_class: type) -> None:
    log_rank0(logger, "%s (DeepSpeed's CPU kernel, asked for by the offload_optimizer section) is served as "
              "torch.optim.%s over the same parameter groups; zerodist steps it over its shards", name,
              torch_class.__name__)
