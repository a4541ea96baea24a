"""``deepspeed.runtime.zero.utils``: the exception type DeepSpeed scripts catch."""

__all__ = ["ZeRORuntimeException"]


class ZeRORuntimeException(Exception):  # noqa: N818 - DeepSpeed's name
    """DeepSpeed's ZeRO runtime error type (zerodist raises its own, more specific errors)."""
