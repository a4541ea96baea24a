"""``deepspeed.ops`` under ``import deepspeed`` served by zerodist: only the answer to "is this compiled
op available?": no for every one of DeepSpeed's kernels (``__compatible_ops__``, the builders'
``is_compatible()``), as under a DeepSpeed install whose ops did not build, and yes for ``async_io``
in ``__compatible_ops__`` (NVMe offload is available, without DeepSpeed's aio library). zerodist steps torch
optimizers and writes swap files with plain file I/O (docs/offload.md); DeepSpeed's kernels
themselves (``deepspeed.ops.transformer``, ``FusedAdam``, ...) are not served, but for the two CPU
optimizers accelerate swaps in when the optimizer is offloaded (``deepspeed.ops.adam`` /
``deepspeed.ops.adagrad``), served as torch's (cpu_optimizers.py)."""

from __future__ import annotations

from zerodist.runtime.ops.cpu_optimizers import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam
from zerodist.runtime.ops.op_builder import BUILDERS

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "__compatible_ops__"]

# async_io: yes, in the sense DeepSpeed's scripts and tests ask it (can this install offload to NVMe?):
# zerodist's nvme offload writes its swap files with plain file I/O (docs/offload.md). Its builder
# still has no aio handle to load.
__compatible_ops__: dict[str, bool] = {builder.NAME: builder.NAME == "async_io" for builder in BUILDERS}
