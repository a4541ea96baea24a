"""``deepspeed.module_inject`` under ``import deepspeed`` served by zerodist: only ``tp_shard`` (DeepSpeed's rule
for splitting heads over a group, which Ulysses code calls). AutoTP's injection itself is not served: any other
name is an AttributeError naming zerodist's way (``"tensor_parallel": {"autotp_size": t}``)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"deepspeed.module_inject.{name}: `import deepspeed` is served by zerodist here, which does "
                         "not provide AutoTP injection; use the config's \"tensor_parallel\": {\"autotp_size\": t} "
                         "(docs/tensor_parallel.md)")
