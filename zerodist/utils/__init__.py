"""Layer 1: rank-aware logging and small pure helpers. Imports nothing else from zerodist."""

from zerodist.utils.helpers import did_you_mean, format_bytes, parse_int_env
from zerodist.utils.logging import get_logger, log_rank0
from zerodist.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "did_you_mean", "format_bytes", "get_logger", "log_rank0", "parse_int_env"]
