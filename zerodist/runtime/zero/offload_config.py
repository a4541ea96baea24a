"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums and section classes
(zerodist's own sections, docs/offload.md, with DeepSpeed's derived ``pipeline`` flag)."""

from __future__ import annotations

import enum

from zerodist.config.offload_sections import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """zerodist's `offload_optimizer` section with DeepSpeed's `pipeline` (read or write pipelined)."""

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write
