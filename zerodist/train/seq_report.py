"""The sequence-parallel lines of `zerodist train`'s summary: all-to-all bytes against the formula,
and the activation memory of each rank.

Ulysses, per attention layer and micro-batch (zerodist/sequence/layout.py; B micro-batch, N the
sequence length, H heads, d head dim, P the degree, e bytes per element): each rank sends
e B N d (2H + 2H_kv) (P-1)/P^2 bytes in forward (q, k, v and the output) and the same in backward,
so a micro-step of L layers sends 2 L times that. The tracer's bus bytes of the all-to-alls
labelled "sequence" (zerodist/sequence/layer.py) are exactly what a rank sends, told from the MoE
layers' all-to-alls under --moe --sp.

Activation memory: the bytes of the tensors autograd saves for backward during one micro-step's
forward (torch's saved-tensor hooks), parameters left out, each storage counted once. It is
what sequence parallelism divides: each rank keeps activations for N/P tokens (the attention
scores of Ulysses are N x N for H/P heads, the same 1/P).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from zerodist.sequence.layout import ring_backward_bytes, ring_bytes, ulysses_bytes
from zerodist.utils import format_bytes


class SavedActivations:
    """Counts the bytes autograd saves for backward while `measure()` is active (parameters and
    storages already counted left out)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._seen: set[int] = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and key not in self._parameter_storages:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield


@dataclasses.dataclass(frozen=True)
class SequenceReport:
    degree: int
    method: str
    all_to_all_bytes_per_micro_step: float  # rank 0, tracer bus bytes (the ring: the bytes it sent)
    formula_bytes_per_micro_step: int | None  # Ulysses only (the tracer's all-to-all bytes compare with it)
    activation_bytes: list[int]  # per rank, one micro-step
    ring_formula_bytes_per_micro_step: int | None = None  # the ring: K/V out, dK/dV back, every layer


def ulysses_formula(engine: Any, seq_len: int, gpt: Any, layers: int) -> int:
    """Bytes a rank sends in the all-to-alls of one micro-step (forward and backward) through `layers`
    blocks of the demo GPT configured by `gpt` (all of them, or this rank's pipeline stages'), over
    the heads this rank's tensor slice holds."""
    heads = gpt.n_heads // engine.topology.size("tensor")  # Ulysses splits the heads a tensor rank holds
    one_layer = ulysses_bytes(batch=engine.batch.micro_batch_size, seq=seq_len, heads=heads, kv_heads=heads,
                              head_dim=gpt.d_model // gpt.n_heads, degree=engine.topology.size("sequence"),
                              element_size=engine.policy.param_dtype.itemsize)
    return 2 * layers * one_layer


def ring_formula(engine: Any, seq_len: int, gpt: Any, layers: int) -> int:
    """Bytes a rank sends for the ring in one micro-step (forward and backward) through `layers` blocks."""
    shape = dict(batch=engine.batch.micro_batch_size, seq=seq_len, kv_heads=gpt.n_heads // engine.topology.size("tensor"),
                 head_dim=gpt.d_model // gpt.n_heads, degree=engine.topology.size("sequence"),
                 element_size=engine.policy.param_dtype.itemsize)
    return layers * (ring_bytes(**shape) + ring_backward_bytes(**shape))


def report_lines(report: SequenceReport) -> list[str]:
    lines = [f"sequence parallel ({report.method}, degree {report.degree}):"]
    if report.formula_bytes_per_micro_step is not None:
        measured, expected = report.all_to_all_bytes_per_micro_step, report.formula_bytes_per_micro_step
        verdict = "matches" if measured == expected else f"differs by {format_bytes(measured - expected)}"
        lines.append(f"  all-to-all per micro-step on rank 0: {format_bytes(measured)} sent (tracer); formula "
                     f"2 L e B N d (2H + 2H_kv) (P-1)/P^2 = {format_bytes(expected)} ({verdict})")
    else:
        measured, ring = report.all_to_all_bytes_per_micro_step, report.ring_formula_bytes_per_micro_step
        ring_text = "-" if ring is None else format_bytes(ring)
        verdict = "" if ring is None else " (matches)" if measured == ring else f" (differs by {format_bytes(measured - ring)})"
        lines.append(f"  ring per micro-step on rank 0: {format_bytes(measured)} sent point to point (tracer); formula "
                     f"L (3P-2) x 2 e B (N/P) H_kv d (K/V blocks rotated P-1 hops forward and backward, dK/dV P "
                     f"hops) = {ring_text}{verdict}")
    if not report.activation_bytes:  # a pipeline's executor runs the stages' forwards, not the demo loop
        lines.append("  activation memory per rank: not measured under a pipeline")
        return lines
    per_rank = ", ".join(f"rank {rank} {format_bytes(b)}" for rank, b in enumerate(report.activation_bytes))
    lines.append(f"  activation memory per rank (saved for backward in one micro-step, parameters excluded): {per_rank}")
    return lines
