"""Which dtype each piece of model state has."""

from __future__ import annotations

import dataclasses

import torch

from zerodist.config import Config


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """`param_dtype` for the module's parameters and their gradients (and gradient
    communication); the optimizer always steps an fp32 master copy. In fp32 training the
    master weights *are* the parameters (`needs_master_copy` is False), so no copy exists.
    """

    param_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False

    @property
    def needs_master_copy(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.param_dtype]

    @classmethod
    def from_config(cls, config: Config) -> PrecisionPolicy:
        if config.bf16.enabled:
            return cls(torch.bfloat16, loss_scaling=False)
        if config.fp16.enabled:
            return cls(torch.float16, loss_scaling=True)
        return cls()
