"""Named errors of the swap tier: each says which file or directory, what is wrong, and what to do."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base of every offload error."""


class SwapPathError(OffloadError):
    """`nvme_path` is missing, not a directory, or not writable."""


class SwapSpaceError(OffloadError):
    """The disk under `nvme_path` has no room for the swap files (checked at start-up, and on every write)."""


class SwapFileError(OffloadError):
    """A swap file is missing, truncated or unreadable: the state it held is gone (resume from a checkpoint)."""


class SwapChecksumError(SwapFileError):
    """A swap file no longer holds what was written to it (overwritten, a bit flipped, files swapped)."""
