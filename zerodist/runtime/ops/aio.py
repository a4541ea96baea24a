"""``deepspeed.ops.aio``: ``AsyncIOBuilder``, never compatible here (zerodist's swap files use plain
file I/O)."""

from zerodist.runtime.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
