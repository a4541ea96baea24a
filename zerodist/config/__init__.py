"""Layer 2: the typed, validated configuration (DeepSpeed-compatible JSON in, frozen objects out).

Imports only ``zerodist.utils`` and pydantic: no torch, no ``zerodist.comm``, so a config can
be checked (``zerodist config show``) on a machine without a GPU or a process group.
"""

from zerodist.config.auto import TrainerValues, resolve_auto
from zerodist.config.batch import BatchSizes, resolve_batch_sizes
from zerodist.config.errors import ConfigError
from zerodist.config.markdown import render_defaults_markdown
from zerodist.config.schema import (
    Bf16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    Config,
    DebugConfig,
    Fp16Config,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    ZerodistConfig,
)
from zerodist.config.show import show_config

__all__ = [
    "BatchSizes",
    "Bf16Config",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "Config",
    "ConfigError",
    "DebugConfig",
    "Fp16Config",
    "MonitorConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainerValues",
    "ZeroConfig",
    "ZerodistConfig",
    "render_defaults_markdown",
    "resolve_auto",
    "resolve_batch_sizes",
    "show_config",
]
