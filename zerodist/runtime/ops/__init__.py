"""``deepspeed.ops`` under ``import deepspeed`` served by zerodist: only the answer to "is this compiled
op available?", which is no for every one of DeepSpeed's (``__compatible_ops__``, the builders'
``is_compatible()``), as under a DeepSpeed install whose ops did not build. zerodist steps torch
optimizers and writes swap files with plain file I/O (docs/offload.md); DeepSpeed's kernels
themselves (``deepspeed.ops.adam``, ``deepspeed.ops.transformer``, ...) are not served."""

from __future__ import annotations

from zerodist.runtime.ops.op_builder import BUILDERS

__all__ = ["__compatible_ops__"]

__compatible_ops__: dict[str, bool] = {builder.NAME: False for builder in BUILDERS}
