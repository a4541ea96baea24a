"""The data-loader adapter: every sequence rank reads the same samples (the engine's loader deals
batches over data x expert only) and keeps its own slice of each sequence.

What a rank gets from a batch of N-token sequences (`shard_batch`):
- a dict (Hugging Face style): every tensor whose second dimension is N, sliced by the rank's
  layout (contiguous for Ulysses, head-tail chunks for the ring); `position_ids` made as 0..N-1
  when absent (the model cannot number its tokens from a slice); `shift_labels` made from
  `labels` before the split ([Note: labels shifted before the split]); an `attention_mask` of all
  ones dropped, any other refused (mark padding with label -100 instead).
- a tuple or list (the demo's `(inputs, targets)`, targets already the next tokens): each
  tensor of length N sliced, and the position ids appended.

[Note: labels shifted before the split] A causal LM predicts token t+1 at position t. A model that
shifts its labels itself (Hugging Face's loss without `shift_labels`) would, on a slice, drop the
label of the slice's last token (the next slice's first token) and predict one token too many
across every boundary. Shifting the whole sequence's labels first (the last position gets -100)
gives each slice exactly the labels of its own positions, so the slices' token losses are the
one-process tokens' losses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.layout import SequenceLayout

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[:, 1:] with -100 at the end: the label of each position is the next token's."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _slice(value: Any, length: int, rows: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
        return value.index_select(1, rows.to(value.device))
    return value


def shard_batch(batch: Any, layout: SequenceLayout) -> Any:
    """This rank's slice of `batch` (see the module's docstring)."""
    if isinstance(batch, dict):
        return _shard_dict(batch, layout)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 2:
        length = batch[0].shape[1]
        rows = layout.token_indices(length)
        positions = torch.arange(length, device=batch[0].device).expand(batch[0].shape[0], length)
        return type(batch)([*(_slice(t, length, rows) for t in batch), positions.index_select(1, rows)])
    raise SequenceParallelError(
        f"cannot split a batch of type {type(batch).__name__} over the sequence: give a dict with 'input_ids' "
        "(Hugging Face style) or a tuple whose first tensor is (batch, seq) token ids")


def _shard_dict(batch: dict[str, Any], layout: SequenceLayout) -> dict[str, Any]:
    if "input_ids" not in batch:
        raise SequenceParallelError(f"a sequence-parallel batch needs 'input_ids' (batch, seq); it has {sorted(batch)}")
    ids = batch["input_ids"]
    length = ids.shape[1]
    rows = layout.token_indices(length)
    batch = dict(batch)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(length, device=ids.device).expand(ids.shape[0], length)
    if batch.get("labels") is not None and batch.get("shift_labels") is None:
        batch["shift_labels"] = shift_labels(batch["labels"])
    mask = batch.pop("attention_mask", None)
    if mask is not None and not bool(mask.bool().all()):
        raise SequenceParallelError(
            "the batch has an attention_mask with padding; sequence-parallel attention is causal over the whole "
            "sequence and takes no mask: label padding -100 (it then counts in no loss) or pack the sequences")
    return {key: _slice(value, length, rows) for key, value in batch.items()}


class SequenceShardLoader:
    """Wraps a data loader: each batch it yields is this rank's slice (`shard_batch`). Length,
    `state_dict()` / `load_state_dict()` and other attributes are the wrapped loader's."""

    def __init__(self, loader: Any, layout: SequenceLayout) -> None:
        self.loader, self.layout = loader, layout

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield shard_batch(batch, self.layout)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "layout"):  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
