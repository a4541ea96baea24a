"""Which dtype each piece of model state has."""

from __future__ import annotations

import dataclasses

import torch

from zerodist.config import Config


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """`param_dtype` for the module's parameters and their gradients (and gradient
    communication). Mixed precision (bf16, fp16) steps an fp32 master copy; in fp32 training the
    master weights *are* the parameters (`needs_master_copy` is False), so no copy exists, and
    likewise in fp64 training, which a model whose every floating parameter is fp64 gets when the
    config asks for neither bf16 nor fp16 (`for_model`): DeepSpeed trains such a model in fp64 too.
    """

    param_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False

    @property
    def needs_master_copy(self) -> bool:
        return self.param_dtype in (torch.bfloat16, torch.float16)

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16",
                torch.float16: "fp16"}[self.param_dtype]

    def for_model(self, model: torch.nn.Module) -> PrecisionPolicy:
        """fp64 for a model whose floating parameters are all fp64 when the config chose no mixed
        precision (casting it to fp32 would lose what the user built it for); else this policy.
        A model mixing fp64 with other dtypes keeps the fp32 policy (and its recast warning)."""
        if self.param_dtype != torch.float32:
            return self
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        return PrecisionPolicy(torch.float64) if dtypes == {torch.float64} else self

    def describe_recast(self, model: torch.nn.Module) -> str | None:
        """What initialize() will cast that the user chose: floating parameters and buffers in a
        dtype that is neither fp32 (the ordinary starting point, cast to `param_dtype` by design)
        nor `param_dtype` itself, such as a layer made fp16 by hand in an fp32 or bf16 run. None
        when there is none."""
        modules: dict[torch.dtype, list[str]] = {}
        for name, module in model.named_modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            for dtype in sorted({t.dtype for t in own if t.is_floating_point()}, key=str):
                if dtype not in (torch.float32, self.param_dtype):
                    modules.setdefault(dtype, []).append(name or "<root>")
        if not modules:
            return None
        held = "; ".join(f"{_dtype_name(dtype)} in {_listed(names)}" for dtype, names in modules.items())
        return (f"initialize(): the model holds {held}; the config trains in {self.name}, so they are cast to "
                f"{_dtype_name(self.param_dtype)} (every trained parameter has the one dtype the config's "
                "\"bf16\"/\"fp16\" sections choose). Build those modules in float32 "
                "to silence this.")

    @classmethod
    def from_config(cls, config: Config) -> PrecisionPolicy:
        if config.bf16.enabled:
            return cls(torch.bfloat16, loss_scaling=False)
        if config.fp16.enabled:
            return cls(torch.float16, loss_scaling=True)
        return cls()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"module{'s' if len(names) > 1 else ''} {shown}{more}"
