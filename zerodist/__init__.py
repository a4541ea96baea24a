"""zerodist: ZeRO-partitioned multi-process training for PyTorch, small, exact and hard to misuse.

    engine, optimizer, dataloader, lr_scheduler = zerodist.initialize(model=model, config="ds_config.json")

DeepSpeed's top-level API (`initialize`, `init_distributed`, `add_config_arguments`, `comm`,
`zero`) has DeepSpeed's signatures, so `import zerodist as deepspeed` runs DeepSpeed scripts
within what docs/deepspeed.md lists.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Lazy attributes: `import zerodist` stays cheap (no torch import) for the CLI and config tools.
_EXPORTS = {
    "initialize": ("zerodist.engine", "initialize"),
    "Engine": ("zerodist.engine", "Engine"),
    "init_distributed": ("zerodist.comm", "init_distributed"),
    "add_config_arguments": ("zerodist.engine.deepspeed_args", "add_config_arguments"),
    "DeepSpeedEngine": ("zerodist.engine", "Engine"),
    "Config": ("zerodist.config", "Config"),
    "ConfigError": ("zerodist.config", "ConfigError"),
    "ShardedParameterError": ("zerodist.zero", "ShardedParameterError"),
    "get_accelerator": ("zerodist.accelerator", "get_accelerator"),
}

__all__ = ["__version__", *_EXPORTS]


# Reached as attributes without an import of their own, as DeepSpeed's are after `import deepspeed`
# (`deepspeed.moe.layer.MoE`, `deepspeed.accelerator.get_accelerator()`); each is imported on first use.
_SUBPACKAGES = {"accelerator", "checkpoint", "comm", "config", "data", "debug", "engine", "integrations", "models",
                "moe", "offload", "pipe", "precision", "runtime", "sequence", "tensor_parallel", "utils", "zero"}


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"zerodist.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zerodist' has no attribute {name!r}")
    import importlib

    module_name, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module_name), attribute)
