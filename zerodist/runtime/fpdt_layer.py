"""``deepspeed.sequence.fpdt_layer``: DeepSpeed's FPDT (fully pipelined distributed transformer: chunked
attention whose chunks are offloaded to host memory), which zerodist does not implement.

The names are here so that a file importing them (DeepSpeed's ``test_ulysses.py`` does, at its top) imports;
using any of them raises NotImplementedError naming what zerodist gives instead, never a stand-in that would
compute something else.
"""

from __future__ import annotations

from typing import Any, NoReturn

_WHY = ("DeepSpeed's FPDT (chunked, host-offloaded Ulysses attention) is not implemented by zerodist; use "
        "Ulysses or ring attention: sequence_parallel_size > 1 with zerodist.sequence_parallel.method "
        "\"ulysses\" or \"ring\" (docs/sequence.md)")


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(f"deepspeed.sequence.fpdt_layer.{name}: {_WHY}")


class _Refused:
    """Refuses construction (modules) and ``apply`` (autograd functions) alike."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__)

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(f"{cls.__name__}.apply")


class FPDT_InputConstruct(_Refused):
    pass


class FPDT_Attention(_Refused):
    pass


class FPDT_FFN(_Refused):
    pass


class FPDT_LogitsLoss(_Refused):
    pass


class SequenceChunk(_Refused):
    pass


class _FPDTGPUAttentionImpl_(_Refused):  # noqa: N801 (DeepSpeed's name)
    pass


class _FPDTGPUOffloadingAttentionImpl_(_Refused):  # noqa: N801 (DeepSpeed's name)
    pass
