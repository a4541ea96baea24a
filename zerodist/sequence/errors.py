"""The named error of sequence parallelism."""

from __future__ import annotations


class SequenceParallelError(ValueError):
    """A configuration or input that sequence parallelism cannot run: heads or a sequence length
    the degree does not divide, a batch without position ids, labels not shifted before the split.
    Raised on every rank before any collective could hang."""
