"""Checkpoint errors: each names the file, tag or rank at fault and what to do."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested tag (or any committed checkpoint) does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed checkpoint is truncated, altered or missing (checksums disagree)."""


class CheckpointWriteError(CheckpointError):
    """Writing failed on some rank (no space, no permission, ...); nothing was committed."""


class CheckpointAgreementError(CheckpointError):
    """The ranks did not all call save_checkpoint, or called it with different tags."""
