"""Whole weights out of an engine at any stage: `save_16bit_model` and `save_pretrained`.

    engine.save_16bit_model("out")                                   # out/pytorch_model.bin (torch.save)
    engine.save_16bit_model("out", "model.safetensors")              # safetensors
    zerodist.checkpoint.save_pretrained(engine, "hf_dir")            # config.json + model*.safetensors

Both are collective (every rank calls them) and write on rank 0 only. The tensors are the
module's own, in its training dtype (bf16/fp16 under mixed precision, as DeepSpeed's
`save_16bit_model`; fp32 otherwise), under the plain model's `state_dict()` keys.

[Note: streamed export] At stage 3 no rank holds the model. The export gathers one unit at a
time (`GatheredParameters`), rank 0 writes that unit's tensors and the unit is released, so
the peak is one gathered unit (plus the persistent parameters every rank holds anyway). The
safetensors header needs every tensor's shape and dtype up front; a sharded parameter keeps its
logical shape, so the header is written first, with the tensors ordered unit by unit, and the
data follows as each unit is gathered. The torch format has no such layout: rank 0 copies each
unit to the CPU and pickles the whole dict at the end (the model once in memory, never twice).

Sliced parameters (tensor parallelism's, found through their declared placements:
`zerodist.comm.slices`) are written unsliced: each chunk's slices are gathered over their axis
(every rank takes part, in the chunk's key order) and the header carries their logical shapes,
so the files hold the plain model's tensors at any tensor degree.
"""

from __future__ import annotations

import copy
import io
import json
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.checkpoint.consolidate import SAFETENSORS_DTYPES
from zerodist.checkpoint.engine_view import HasZeroState
from zerodist.checkpoint.files import AtomicFile, tensor_bytes
from zerodist.comm.slices import ParamSlicing, param_slicings
from zerodist.comm.topology import Topology
from zerodist.utils import get_logger, log_rank0
from zerodist.zero.registry import GatheredParameters
from zerodist.zero.state import ZeroState

logger = get_logger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"


def save_16bit_model(engine: HasZeroState, save_dir: str | Path, save_filename: str = TORCH_WEIGHTS_NAME,
                     exclude_frozen_parameters: bool = False) -> bool:
    """DeepSpeed's `engine.save_16bit_model`: the module's state dict in its training dtype, in one
    file `save_dir/save_filename` (safetensors if the name ends in `.safetensors`, else
    torch.save). Every key of `state_dict()` is written, tied weights under each of their keys, so
    `model.load_state_dict(..., strict=True)` takes it. Collective; returns True."""
    chunks = _chunks(engine.zero_state, exclude_frozen_parameters, drop_tied=False)
    path = Path(save_dir) / save_filename
    if path.suffix == ".safetensors":
        _write_safetensors_shards(chunks, [(path, [key for chunk in chunks for key in chunk.keys])])
    else:
        _write_torch(chunks, path)
    comm.barrier()
    log_rank0(logger, "saved the model's weights (%d tensors, training dtype) to %s", sum(len(c.keys) for c in chunks),
              path)
    return True


def save_pretrained(engine: HasZeroState, save_dir: str | Path, *, max_shard_size: int | str = "5GB",
                    safe_serialization: bool = True) -> Path:
    """A directory `transformers`' `from_pretrained` loads unchanged: the model's config (and
    generation config) and its weights as `save_pretrained` writes them (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` shards of at most `max_shard_size` bytes with
    `model.safetensors.index.json`; `pytorch_model.bin` with `safe_serialization=False`). Tied
    weights are written once, under their first name, as `save_pretrained` does. Works at every
    stage; collective. Returns the directory."""
    save_dir = Path(save_dir)
    state = engine.zero_state
    chunks = _chunks(state, exclude_frozen=False, drop_tied=True)
    if comm.get_rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        _write_configs(state.module, save_dir)
    if not safe_serialization:
        _write_torch(chunks, save_dir / TORCH_WEIGHTS_NAME)
    else:
        planned = _plan_shards(chunks, _parse_size(max_shard_size))
        if len(planned) == 1:
            shards = [(save_dir / SAFE_WEIGHTS_NAME, planned[0])]
        else:
            shards = [(save_dir / f"model-{i + 1:05d}-of-{len(planned):05d}.safetensors", keys)
                      for i, keys in enumerate(planned)]
        _write_safetensors_shards(chunks, shards)
        if len(shards) > 1 and comm.get_rank() == 0:
            _write_index(chunks, shards, save_dir / SAFE_WEIGHTS_INDEX_NAME)
    comm.barrier()
    return save_dir


class _Chunk:
    """State-dict entries gathered together: one stage-3 unit's, or those every rank holds."""

    def __init__(self, params: Sequence[torch.Tensor], topology: Topology):
        self.params, self.topology = params, topology
        self.keys: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}  # references (sharded outside the gather)
        self.positions: dict[str, int] = {}  # each key's place in state_dict() order
        self.sliced: dict[str, ParamSlicing] = {}  # sliced parameters by key

    def shape(self, key: str) -> list[int]:
        """The tensor's shape as written: a slice's logical (unsliced) shape."""
        return list(self.sliced[key].logical_shape if key in self.sliced else self.tensors[key].shape)

    def nbytes(self, key: str) -> int:
        numel = 1
        for length in self.shape(key):
            numel *= length
        return numel * self.tensors[key].element_size()


def _chunks(state: ZeroState, exclude_frozen: bool, drop_tied: bool) -> list[_Chunk]:
    """The module's state-dict entries grouped by the unit that holds them, in unit order, with
    those held by every rank first ([Note: streamed export])."""
    module = state.module
    unit_params = [[p for g in unit.groups for p in g.params] for unit in state.units]
    chunks = [_Chunk([], state.topology)] + [_Chunk(params, state.topology) for params in unit_params]
    chunk_of = {id(p): index + 1 for index, params in enumerate(unit_params) for p in params}
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    sliced = param_slicings(module, state.topology)
    seen: set[int] = set()
    for position, (key, tensor) in enumerate(module.state_dict(keep_vars=True).items()):
        if exclude_frozen and isinstance(tensor, torch.nn.Parameter) and id(tensor) not in trained:
            continue
        if drop_tied and id(tensor) in seen:
            continue
        seen.add(id(tensor))
        chunk = chunks[chunk_of.get(id(tensor), 0)]
        chunk.keys.append(key)
        chunk.tensors[key] = tensor
        chunk.positions[key] = position
        if id(tensor) in sliced:
            chunk.sliced[key] = sliced[id(tensor)]
    return [c for c in chunks if c.keys]


def _gathered(chunks: list[_Chunk]) -> Iterator[tuple[_Chunk, dict[str, torch.Tensor]]]:
    """Each chunk with its tensors' full values on the CPU (on rank 0; empty elsewhere), one unit
    gathered at a time. Collective."""
    for chunk in chunks:
        with GatheredParameters(chunk.params, enabled=bool(chunk.params)), torch.no_grad():
            # Slices: gathered on every rank (a collective over the slice's axis).
            tensors = {k: chunk.sliced[k].gather(chunk.tensors[k], chunk.topology) if k in chunk.sliced
                       else chunk.tensors[k] for k in chunk.keys}
            values = {}
            if comm.get_rank() == 0:
                values = {k: tensors[k].detach().to("cpu", copy=True).contiguous() for k in chunk.keys}
        yield chunk, values


def _write_torch(chunks: list[_Chunk], path: Path) -> None:
    state: dict[str, torch.Tensor] = {}
    for _, values in _gathered(chunks):
        state.update(values)
    if comm.get_rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    positions = {k: p for chunk in chunks for k, p in chunk.positions.items()}
    ordered = {k: state[k] for k in sorted(state, key=positions.__getitem__)}  # state_dict() order
    buffer = io.BytesIO()
    torch.save(ordered, buffer)
    with AtomicFile(path) as f:
        f.write(buffer.getbuffer())
        f.commit()


def _plan_shards(chunks: list[_Chunk], max_bytes: int) -> list[list[str]]:
    """Keys in write order, cut into consecutive files of at most `max_bytes` (a tensor larger
    than that gets a file of its own), as `save_pretrained` shards."""
    shards: list[list[str]] = [[]]
    size = 0
    for chunk in chunks:
        for key in chunk.keys:
            nbytes = chunk.nbytes(key)
            if shards[-1] and size + nbytes > max_bytes:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += nbytes
    return shards


def _write_safetensors_shards(chunks: list[_Chunk], shards: list[tuple[Path, list[str]]]) -> None:
    """Stream the chunks into the shard files: each file's header first, then its tensors as
    their units are gathered ([Note: streamed export])."""
    info = {k: (chunk.tensors[k].dtype, chunk.shape(k), chunk.nbytes(k)) for chunk in chunks for k in chunk.keys}
    files = iter(shards)
    current: tuple[AtomicFile, list[str]] | None = None
    written = 0
    for _, values in _gathered(chunks):
        for key, value in values.items():  # rank 0 only
            if current is None or written == len(current[1]):
                if current is not None:
                    current[0].commit()
                path, keys = next(files)
                path.parent.mkdir(parents=True, exist_ok=True)
                current, written = (AtomicFile(path), keys), 0
                _write_header(current[0], [(k, info[k]) for k in keys])
            assert current[1][written] == key, f"export order: expected {current[1][written]}, got {key}"
            if value.numel():
                current[0].write(tensor_bytes(value))
            written += 1
    if current is not None:
        current[0].commit()


def _write_header(out: AtomicFile, entries: list[tuple[str, tuple[torch.dtype, list[int], int]]]) -> None:
    """`entries`: (key, (dtype, shape as written, bytes)) in file order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, (dtype, shape, nbytes) in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: dtype {dtype} has no safetensors code")
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape,
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    out.write(struct.pack("<Q", len(text)))
    out.write(text)


def _write_index(chunks: list[_Chunk], shards: list[tuple[Path, list[str]]], path: Path) -> None:
    index = {"metadata": {"total_size": sum(chunk.nbytes(k) for chunk in chunks for k in chunk.keys)},
             "weight_map": {key: file.name for file, keys in shards for key in keys}}
    with AtomicFile(path) as f:
        f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8") + b"\n")
        f.commit()


def _write_configs(module: torch.nn.Module, save_dir: Path) -> None:
    """The model's config as `save_pretrained` writes it: a copy naming the architecture."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    floating = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if floating is not None:  # the dtype the weights are written in, which from_pretrained(dtype="auto") reads
        config.dtype = str(floating).removeprefix("torch.")
    config.save_pretrained(save_dir)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(save_dir)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def _parse_size(size: int | str) -> int:
    """`max_shard_size` as `save_pretrained` takes it: bytes, or "5GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a size such as '5GB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
