"""zerodist: ZeRO-partitioned multi-process training for PyTorch, small, exact and hard to misuse."""

__version__ = "0.1.0"
