"""Between the engine's flat layout and the checkpoint's per-parameter slices.

Save: for each bucket of each flat group, a rank writes its own shard of every optimizer-space
tensor (the fp32 values the optimizer steps, and each per-element optimizer state such as
Adam's `exp_avg`) as one contiguous chunk, and describes the chunk as slices of parameters with
the layout's `owned_slices(rank)`. At stage 0 every rank holds the whole bucket but writes only
its shard, so the ranks write disjoint data in parallel.

Load: a rank asks, for its own (possibly different) layout, which elements of which parameter
it owns, and copies each from the saved slices that overlap it ([Note: layout-free manifest]).

Both sides speak of the *logical* tensor: a parameter that is a slice of a larger one (its
placement cuts dimension d over a mesh axis) maps each of its owned ranges onto the runs of the
logical tensor it covers (`zerodist.zero.layout.slice_runs`), so a tensor saved as slices along
any dimension loads into any other slicing of it, or whole.
Groups whose optimizer steps whole buckets (stage 0) then all-gather the shards, and each group
refreshes its parameters from its optimizer tensors (`copy_master_to_params`, `gather_params`),
so the model, the master weights and the optimizer state agree whatever the stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.checkpoint.errors import CheckpointCorruptError, CheckpointError
from zerodist.checkpoint.files import RangeReader
from zerodist.checkpoint.manifest import OPTIMIZER_PREFIX, PARAM, Manifest
from zerodist.comm.slices import ParamSlicing
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.layout import slice_runs


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of parameter `name`, at element `at` of chunk `chunk`."""

    name: str
    kind: str
    start: int
    length: int
    chunk: int
    at: int


@dataclasses.dataclass(frozen=True)
class Request:
    """What one rank needs: `length` elements of (`name`, `kind`) from `start`, stored at
    element `at` of its part of the bucket."""

    name: str
    kind: str
    start: int
    length: int
    at: int


def bucket_slices(group: FlatParamGroup) -> list[list[tuple[int, int, int, int]]]:
    """Per bucket, this rank's (param index, param start, length, offset within its bucket shard)."""
    layout = group.layout
    bases, base = [], 0
    for span in layout.buckets:
        bases.append(base)
        base += span.shard_numel
    per_bucket: list[list[tuple[int, int, int, int]]] = [[] for _ in layout.buckets]
    for s in layout.owned_slices(group.rank):
        bucket = layout.slots[s.param_index].bucket
        per_bucket[bucket].append((s.param_index, s.param_start, s.length, s.shard_start - bases[bucket]))
    return per_bucket


def logical_runs(record: Any, start: int, length: int) -> list[tuple[int, int, int]]:
    """`(logical start, length, offset)` runs of elements [start, start + length) of `record`'s parameter."""
    placement = record.placement
    if placement.fused or placement.logical_size is not None:
        # Fused sub-tensors or padded parts (tensor parallelism): padding belongs to no run.
        return ParamSlicing.of(placement, tuple(record.shape), record.part, record.num_parts).runs(start, length)
    return slice_runs(start, length, shape=record.shape, dim=record.placement.slice_dim, part=record.part,
                      num_parts=record.num_parts)


def optimizer_space(group: FlatParamGroup, index: int, state: Any) -> dict[str, torch.Tensor]:
    """Bucket `index`'s per-element tensors: the stepped values and each elementwise state."""
    tensor = group.optimizer_tensors[index]
    kinds = {PARAM: group.stepped_values(index)}  # read back when held in swap files (zerodist.offload)
    for key, value in state.get(tensor, {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != tensor.numel():
                raise CheckpointError(f"optimizer state {key!r} has {value.numel()} elements for a tensor of "
                                      f"{tensor.numel()}: only elementwise optimizer state can be checkpointed")
            kinds[OPTIMIZER_PREFIX + key] = value
    return kinds


def collect_chunks(groups: list[Any], state: Any) -> tuple[list[tuple[str, torch.Tensor]], list[Piece]]:
    """This rank's chunks (kind, 1-D tensor) and the parameter slices they hold."""
    chunks: list[tuple[str, torch.Tensor]] = []
    pieces: list[Piece] = []
    for group in groups:
        per_bucket = bucket_slices(group)
        for index in range(len(group.optimizer_tensors)):
            for kind, full in optimizer_space(group, index, state).items():
                chunks.append((kind, group.owned_part(index, full).detach()))
                for param_index, start, length, at in per_bucket[index]:
                    record = group.records[param_index]
                    if not record.placement.in_norm:
                        # A copy whose owner, another pipeline stage, writes it (a tied layer: [Note:
                        # copies counted elsewhere] in zerodist/comm/domains.py), so every element of
                        # the checkpoint is written once and the manifest's tiling check stays exact.
                        continue
                    for logical, run, offset in logical_runs(record, start, length):
                        pieces.append(Piece(record.name, kind, logical, run, len(chunks) - 1, at + offset))
    return chunks, pieces


def collect_scalars(groups: list[Any], inner: torch.optim.Optimizer) -> dict[str, Any]:
    """Rank 0's optimizer settings by parameter name: its param group's options and the
    non-elementwise state (Adam's `step`) of the bucket holding it. Identical on every rank."""
    group_index = {id(t): j for j, pg in enumerate(inner.param_groups) for t in pg["params"]}
    group_of: dict[str, int] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for group in groups:
        for index, tensor in enumerate(group.optimizer_tensors):
            values = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in inner.state.get(tensor, {}).items()
                      if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
            for param_index in group.layout.buckets[index].param_indices:
                name = group.records[param_index].name
                group_of[name] = group_index[id(tensor)]
                scalars[name] = values
    options = [{k: v for k, v in pg.items() if k != "params"} for pg in inner.param_groups]
    return {"class": type(inner).__name__, "options": options, "group_of": group_of, "scalars": scalars}


# ---------------------------------------------------------------------------------------- load

def check_parameters(shapes: dict[str, tuple[int, ...]], manifest: Manifest) -> None:
    """The checkpoint must hold exactly the trained parameters (logical name -> logical shape, over
    every rank), with the same shapes."""
    missing = sorted(set(shapes) - set(manifest.params))
    unexpected = sorted(set(manifest.params) - set(shapes))
    wrong = [f"{n}: {tuple(manifest.params[n]['shape'])} in the checkpoint, {shapes[n]} in the model"
             for n in shapes if n in manifest.params and tuple(manifest.params[n]["shape"]) != shapes[n]]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"not trained by this model: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    problems += wrong
    if problems:
        raise CheckpointError(f"checkpoint {manifest.tag} does not match the model: " + "; ".join(problems))


def bucket_kinds(group: FlatParamGroup, index: int, manifest: Manifest, with_optimizer: bool) -> list[str]:
    """Kinds to load for bucket `index`: every parameter in a bucket shares one optimizer."""
    names = [group.records[p].name for p in group.layout.buckets[index].param_indices]
    if not with_optimizer:
        return [PARAM]
    kinds = manifest.kinds(names[0])
    for name in names[1:]:
        if set(manifest.kinds(name)) != set(kinds):
            raise CheckpointError(f"checkpoint {manifest.tag}: {name} has optimizer state {manifest.kinds(name)} "
                                  f"but {names[0]}, stepped together with it now, has {kinds}")
    return sorted(kinds, key=lambda k: k != PARAM)


def plan_group(group: FlatParamGroup, manifest: Manifest,
               with_optimizer: bool) -> Iterator[tuple[int, str, list[Request]]]:
    """Per (bucket, kind): the requests that fill this rank's part of it."""
    per_bucket = bucket_slices(group)
    for index in range(len(group.optimizer_tensors)):
        for kind in bucket_kinds(group, index, manifest, with_optimizer):
            yield index, kind, [Request(group.records[p].name, kind, logical, run, at + offset)
                                for p, start, length, at in per_bucket[index]
                                for logical, run, offset in logical_runs(group.records[p], start, length)]


def files_needed(groups: list[Any], manifest: Manifest, with_optimizer: bool) -> set[str]:
    needed: set[str] = set()
    for group in groups:
        for _, _, requests in plan_group(group, manifest, with_optimizer):
            for r in requests:
                needed.update(s.file for s in _overlapping(manifest, r))
    return needed


def _overlapping(manifest: Manifest, r: Request) -> Iterator[Any]:
    _, slices = manifest.slices(r.name, r.kind)
    return (s for s in slices if s.start < r.start + r.length and r.start < s.start + s.length)


def fill(r: Request, out: torch.Tensor, manifest: Manifest, reader: RangeReader) -> None:
    """Copy the requested elements into `out` (`r.length` elements) from the overlapping slices."""
    dtype_name, _ = manifest.slices(r.name, r.kind)
    dtype = getattr(torch, dtype_name)
    covered = 0
    for s in _overlapping(manifest, r):
        lo, hi = max(r.start, s.start), min(r.start + r.length, s.start + s.length)
        target = out[lo - r.start: hi - r.start]
        buffer = target if target.dtype == dtype else torch.empty(hi - lo, dtype=dtype)
        reader.read_into(s.file, s.offset + (lo - s.start) * buffer.element_size(), buffer)
        if buffer is not target:
            target.copy_(buffer)
        covered += hi - lo
    if covered != r.length:
        raise CheckpointCorruptError(f"checkpoint {manifest.tag}: {r.kind} of {r.name} covers {covered} of the "
                                     f"{r.length} elements from {r.start}")


@torch.no_grad()
def load_groups(groups: list[Any], manifest: Manifest, reader: RangeReader, with_optimizer: bool
                ) -> dict[int, dict[str, torch.Tensor]]:
    """Fill every group's optimizer tensors (and parameters); returns the loaded elementwise
    optimizer state by id of the optimizer tensor."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    for group in groups:
        held = group.stepped_store is not None  # values in swap files: loaded here, then written there
        failure: Exception | None = None  # a swap write that failed here: agreed after the group's gathers
        for index, kind, requests in plan_group(group, manifest, with_optimizer):
            tensor = group.optimizer_tensors[index]
            full = tensor if kind == PARAM and not held else torch.zeros_like(tensor)
            part = group.owned_part(index, full)
            for r in requests:
                fill(r, part[r.at: r.at + r.length], manifest, reader)
            if part.numel() != full.numel():  # the optimizer steps whole buckets: share the shards
                comm.all_gather(full, part.clone(), group=group.group)
            if kind != PARAM:
                states.setdefault(id(tensor), {})[kind[len(OPTIMIZER_PREFIX):]] = full
            elif held and failure is None:
                try:
                    group.write_stepped(index, full)
                except Exception as error:  # noqa: BLE001 - raised on every rank by the store, below
                    failure = error
        if held:
            group.stepped_store.agree(failure)  # one rank's full disk is the same error on every rank
        group.copy_master_to_params()
        if group.gathers_params:  # full parameters: every rank's loaded shards into the full buffer
            group.unshard()
    return states
