"""Loss scaling for fp16, with DeepSpeed's dynamic-scale semantics.

The overflow decision is made by the caller from gradients *after* every rank has agreed
(an all-reduce of the overflow flag), so every rank updates the scale identically.

Dynamic rule (DeepSpeed's DynamicLossScaler): on overflow, if `hysteresis` allows one more
overflow, only the hysteresis counter drops; otherwise the scale halves (not below
`min_loss_scale`). After `loss_scale_window` steps without overflow the scale doubles.
"""

from __future__ import annotations

from typing import Any

from zerodist.config import Fp16Config


class LossScaler:
    """`scale` multiplies the loss before backward; `update(overflow)` after each step."""

    def __init__(
        self,
        *,
        dynamic: bool,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ):
        self.dynamic = dynamic
        self.scale = float(init_scale)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.steps_since_overflow = 0
        self.num_overflows = 0

    @classmethod
    def from_fp16_config(cls, fp16: Fp16Config) -> LossScaler:
        """The config's `fp16` section, sliced for the scaler (ZeroSettings.from_config hands it in)."""
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls(dynamic=False, init_scale=fp16.loss_scale)
        return cls(
            dynamic=True, init_scale=2.0**fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis, min_scale=fp16.min_loss_scale,
        )

    @classmethod
    def disabled(cls) -> LossScaler:
        return cls(dynamic=False, init_scale=1.0)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.num_overflows += 1
            self.steps_since_overflow = 0
            if not self.dynamic:
                return
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.steps_since_overflow += 1
        if self.dynamic and self.steps_since_overflow % self.scale_window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": self.dynamic, "scale": self.scale, "scale_window": self.scale_window,
            "hysteresis": self.hysteresis, "min_scale": self.min_scale, "hysteresis_left": self.hysteresis_left,
            "steps_since_overflow": self.steps_since_overflow, "num_overflows": self.num_overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"unknown loss-scaler state {key!r}")
            setattr(self, key, value)
