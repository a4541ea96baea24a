"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, DeepSpeed's parsed ``zero_optimization``
section, as zerodist reads it.

The keyword arguments are the section's keys. DeepSpeed's deprecated keys mean what DeepSpeed makes
of them (``cpu_offload: true`` is ``offload_optimizer: {device: cpu}``, ``cpu_offload_param`` the
same for ``offload_param``, ``stage3_gather_fp16_weights_on_model_save`` the 16-bit key); the rest
goes through zerodist's own config loader (``zerodist.config.Config``: its checks, its defaults,
DeepSpeed's un-prefixed ZeRO-3 names). The attributes are DeepSpeed's names of the result
(``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``, ...) and zerodist's field names; a value
is what zerodist does, e.g. ``overlap_comm`` is True at every stage by default here (docs/config.md).
"""

from __future__ import annotations

from typing import Any

from zerodist.config import Config, ZeroConfig
from zerodist.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum"]

# DeepSpeed's attribute name -> zerodist's key (the config file may use either).
_DEEPSPEED_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


def _undeprecate(section: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's deprecated keys as DeepSpeed translates them."""
    section = dict(section)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in section:
            if section.pop(old) is True:
                section.setdefault(new, {"device": OffloadDeviceEnum.cpu.value})
    section.pop("cpu_offload_use_pin_memory", None)
    if "stage3_gather_fp16_weights_on_model_save" in section:
        section.setdefault("stage3_gather_16bit_weights_on_model_save",
                           section.pop("stage3_gather_fp16_weights_on_model_save"))
    return section


class DeepSpeedZeroConfig:
    """A `zero_optimization` section, checked by zerodist, read under DeepSpeed's attribute names."""

    def __init__(self, **section: Any) -> None:
        section = _undeprecate(section)
        # Each section alone, as DeepSpeed's model checks it; whether the stage allows offload is the
        # engine's check (deepspeed.initialize refuses offload at stage 0), not the section's.
        optimizer, param = section.pop("offload_optimizer", None), section.pop("offload_param", None)
        self.zerodist: ZeroConfig = Config.load({"zero_optimization": section}).zero_optimization
        self.offload_optimizer = None if optimizer is None else DeepSpeedZeroOffloadOptimizerConfig(**optimizer)
        self.offload_param = None if param is None else DeepSpeedZeroOffloadParamConfig(**param)
        # Whole checkpoints are loaded by every stage here; DeepSpeed's pipeline flag is false for them.
        self.pipeline_loading_checkpoint = False

    def __getattr__(self, name: str) -> Any:
        zerodist = self.__dict__.get("zerodist")
        if zerodist is None:
            raise AttributeError(name)
        return getattr(zerodist, _DEEPSPEED_NAMES.get(name, name))

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self.zerodist!r})"
