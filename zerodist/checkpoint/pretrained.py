"""Pretrained weights into a live engine, each rank reading only what it holds.

    with zerodist.zero.Init():
        model = LlamaForCausalLM(config)                 # nothing allocated
    engine, *_ = zerodist.initialize(model=model, config=ds_config)   # stage 3: shards only
    zerodist.checkpoint.load_pretrained(engine, "llama_dir")          # each rank reads its slices

[Note: sliced load] A source is a `save_pretrained` directory (`model.safetensors`, or shards
with `model.safetensors.index.json`; `pytorch_model.bin` likewise), or one safetensors or torch
file. Safetensors files are memory-mapped (`safe_open`) and read through `get_slice`; torch
files are loaded with `mmap=True`, so only the pages sliced are read either way. At stage 3 a
rank owns, for each parameter of each flat group, at most a few contiguous runs of its
flattened elements (`FlatLayout.owned_slices`); for each run the loader reads the rows of the
parameter's first dimension that contain it (at most one partial row more at each end), writes
the run into the rank's parameter shard and, under mixed precision, into the fp32 master
weights, and drops the read. No collective runs, no rank ever holds a whole unit, and the
values are those an eager `load_state_dict` gives, bit for bit (same source values, same casts).
Parameters every rank holds (stages 0-2, stage 3's persistent ones, frozen ones under the
persistence threshold) and buffers are read whole.

A parameter whose declared placement slices it (a tensor-parallel layer's) holds part of its
logical tensor (`zerodist.comm.slices`): read whole, the logical tensor is cut to this rank's
slice (`ParamSlicing.cut`, padding a vocabulary); at stage 3 each owned run of the local slice maps
to runs of the logical tensor (`ParamSlicing.runs`), and only those are read. The source's shapes
are the unparallelized model's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from zerodist.checkpoint.engine_view import HasZeroState
from zerodist.checkpoint.errors import CheckpointError
from zerodist.comm.slices import ParamSlicing, param_slicings
from zerodist.zero.flat_group import FlatParamGroup


@dataclasses.dataclass
class LoadReport:
    """What `load_pretrained` did on this rank."""

    files: list[str]
    loaded_keys: int
    bytes_read: int = 0  # bytes of tensor data read from the files (slices included)
    largest_read: int = 0  # the largest single read, the most the load holds at once


class _Source:
    """The tensors of a checkpoint, by name, readable in row ranges without loading whole files."""

    def __init__(self, path: str | Path):
        self.files = _resolve_files(Path(path))
        self.handles: dict[str, Any] = {}  # key -> safe_open handle or a memory-mapped state dict
        for file in self.files:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                handle = safe_open(str(file), framework="pt")
                self.handles.update({key: handle for key in handle.keys()})
            else:
                state = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
                self.handles.update({key: state for key in state})

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self.handles[key]
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the first dimension (all of a 0-d tensor)."""
        handle = self.handles[key]
        if isinstance(handle, dict):
            tensor = handle[key]
            return (tensor if tensor.dim() == 0 or start is None else tensor[start:stop]).clone()
        if start is None or len(self.shape(key)) == 0:
            return handle.get_tensor(key)
        return handle.get_slice(key)[start:stop]


def _resolve_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"load_pretrained: {path} is neither a file nor a directory")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise CheckpointError(f"load_pretrained: {path} holds no model.safetensors, pytorch_model.bin or their "
                          "*.index.json (the layout save_pretrained writes)")


def load_pretrained(engine: HasZeroState, path: str | Path, *, strict: bool = True) -> LoadReport:
    """Load the weights at `path` into `engine`'s model, at any ZeRO stage (see [Note: sliced
    load]). Tied weights need one of their names in the source. With `strict`, a key of the
    model (parameter or persistent buffer) missing from the source, or a key of the source the
    model lacks, is an error, raised before anything is written. Not collective: every rank
    reads its own part. Returns what this rank read."""
    state = engine.zero_state  # the typed view; checkpoint/ reads no engine internals
    source = _Source(path)
    names = _names_by_tensor(state.module)
    slicings = param_slicings(state.module, state.topology)
    _check_keys(state.module, source, names, slicings, strict)
    report = LoadReport([str(f) for f in source.files], 0)
    in_groups: set[int] = set()
    with torch.no_grad():
        for group in [*state.groups, *state.frozen_groups]:  # stage 3 shards frozen parameters too
            in_groups.update(id(p) for p in group.params)
            _load_group(group, source, names, slicings, report)
        for tensor in [*state.module.parameters(), *state.module.buffers()]:
            key = _source_key(tensor, names, source)
            if id(tensor) not in in_groups and key is not None:
                tensor.copy_(_read_whole(source, key, tensor, slicings, report))
                report.loaded_keys += 1
    return report


def _logical_shape(tensor: torch.Tensor, slicings: dict[int, ParamSlicing]) -> list[int]:
    """The shape of the tensor `tensor` is a slice of (its own shape if none)."""
    return list(slicings[id(tensor)].logical_shape if id(tensor) in slicings else tensor.shape)


def _read_whole(source: _Source, key: str, tensor: torch.Tensor, slicings: dict[int, ParamSlicing],
                report: LoadReport) -> torch.Tensor:
    """`tensor`'s values from the source: the whole tensor, or this rank's slice of it."""
    values = _read(source, key, None, None, report)
    if id(tensor) not in slicings:
        return values.reshape(tensor.shape)
    return slicings[id(tensor)].cut(values.reshape(_logical_shape(tensor, slicings)))


def _names_by_tensor(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(key)
    return names


def _source_key(tensor: torch.Tensor, names: dict[int, list[str]], source: _Source) -> str | None:
    return next((name for name in names.get(id(tensor), []) if name in source.handles), None)


def _check_keys(module: torch.nn.Module, source: _Source, names: dict[int, list[str]],
                slicings: dict[int, ParamSlicing], strict: bool) -> None:
    state = module.state_dict(keep_vars=True)
    missing = sorted({names[id(t)][0] for t in state.values() if _source_key(t, names, source) is None})
    unexpected = sorted(set(source.handles) - set(state))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"load_pretrained: the source does not match {type(module).__name__}'s state_dict(): missing "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}); the keys must be the "
            "plain model's state_dict() keys (pass strict=False to load the ones that match)")
    for tensor in state.values():
        key = _source_key(tensor, names, source)
        if key is not None and math.prod(source.shape(key)) != math.prod(_logical_shape(tensor, slicings)):
            raise CheckpointError(f"load_pretrained: {key} has shape {list(source.shape(key))} in the source and "
                                  f"{_logical_shape(tensor, slicings)} in the model")


def _read(source: _Source, key: str, start: int | None, length: int | None, report: LoadReport) -> torch.Tensor:
    """Elements [start, start + length) of the flattened tensor `key` (all of it for None),
    reading only the first-dimension rows that hold them."""
    shape = source.shape(key)
    if start is None or len(shape) == 0:
        values = source.rows(key).reshape(-1)
    else:
        assert length is not None
        row = math.prod(shape[1:])
        first, last = start // row, -(-(start + length) // row)
        values = source.rows(key, first, last).reshape(-1)[start - first * row: start - first * row + length]
    nbytes = values.numel() * values.element_size()
    report.bytes_read += nbytes
    report.largest_read = max(report.largest_read, nbytes)
    return values


def _load_group(group: FlatParamGroup, source: _Source, names: dict[int, list[str]],
                slicings: dict[int, ParamSlicing],
                report: LoadReport) -> None:
    """One flat group: its owned runs into the shard (and master) at stage 3, else whole
    parameters into the full buffer and the master taken from it."""
    keys = [_source_key(p, names, source) for p in group.params]
    if group.param_shard is None:
        for param, key in zip(group.params, keys):
            if key is not None:
                param.copy_(_read_whole(source, key, param, slicings, report))
        group.take_shard_from_full()
        report.loaded_keys += sum(k is not None for k in keys)
        return
    # Stepped values in swap files (zerodist.offload): the shard is read back, loaded into, written back.
    held = None if group.stepped_store is None else torch.cat(
        [group.stepped_values(i) for i in range(len(group.optimizer_tensors))])
    for piece in group.layout.owned_slices(group.rank):
        key = keys[piece.param_index]
        if key is None:
            continue
        for logical_start, length, offset in _runs(group.params[piece.param_index], piece, slicings):
            values = _read(source, key, logical_start, length, report)
            where = slice(piece.shard_start + offset, piece.shard_start + offset + length)
            if held is not None:
                held[where].copy_(values)
                continue
            if group.master is not None:
                group.master[where].copy_(values)
            group.param_shard[where].copy_(group.master[where] if group.master is not None else values)
    if held is not None:
        for index, part in enumerate(held.split([t.numel() for t in group.optimizer_tensors])):
            group.write_stepped(index, part)
    group.storage.drop_secondary()  # hpZ's copy of the old values (no step drops a frozen group's)
    if group.is_unsharded:  # gathered now (a unit kept between steps): its full values too
        for param, key in zip(group.params, keys):
            if key is not None:
                param.copy_(_read_whole(source, key, param, slicings, report))
    report.loaded_keys += sum(k is not None for k in keys)


def _runs(param: torch.Tensor, piece: Any, slicings: dict[int, ParamSlicing]) -> list[tuple[int, int, int]]:
    """An owned piece of `param` as (start in the source tensor, length, offset in the piece): one
    run, or for a slice the runs of its logical tensor (padding in none)."""
    if id(param) not in slicings:
        return [(piece.param_start, piece.length, 0)]
    return slicings[id(param)].runs(piece.param_start, piece.length)
