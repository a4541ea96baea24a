"""Layer 6: checkpoints that survive crashes and change shape.

Atomic sharded save (`save_checkpoint`), load at any world size and ZeRO stage
(`load_checkpoint`), consolidation to one plain file (`consolidate_checkpoint`,
`save_consolidated`), whole weights out of a live engine (`save_16bit_model`,
`save_pretrained`), pretrained weights in, each rank reading its slices (`load_pretrained`),
integrity reports (`inspect_checkpoints`). The engine's
`save_checkpoint` / `load_checkpoint` delegate here. Format and guarantees: docs/checkpoints.md.
"""

from zerodist.checkpoint.consolidate import consolidate_checkpoint, save_consolidated, write_safetensors
from zerodist.checkpoint.errors import (
    CheckpointAgreementError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from zerodist.checkpoint.export import save_16bit_model, save_pretrained
from zerodist.checkpoint.files import KILL_ENV, KILL_POINTS
from zerodist.checkpoint.inspect import TagReport, inspect_checkpoints
from zerodist.checkpoint.load import latest_tag, load_checkpoint
from zerodist.checkpoint.manifest import Manifest, list_checkpoints, read_manifest
from zerodist.checkpoint.pretrained import LoadReport, load_pretrained
from zerodist.checkpoint.save import IntervalSaves, save_checkpoint

__all__ = [
    "KILL_ENV", "KILL_POINTS", "CheckpointAgreementError", "CheckpointCorruptError", "CheckpointError",
    "CheckpointNotFoundError", "CheckpointWriteError", "IntervalSaves", "LoadReport", "Manifest", "TagReport", "consolidate_checkpoint",
    "inspect_checkpoints", "latest_tag", "list_checkpoints", "load_checkpoint", "load_pretrained", "read_manifest", "save_checkpoint",
    "save_16bit_model", "save_consolidated", "save_pretrained", "write_safetensors",
]
