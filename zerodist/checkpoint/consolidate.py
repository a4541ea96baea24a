"""One file of plain fp32 weights from a sharded checkpoint, with no process group and no pickle.

    state = consolidate_checkpoint("ckpt")                      # newest committed tag
    save_consolidated("ckpt", "model.safetensors")              # or "model.pt" (torch.save)
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))   # no zerodist needed

The result has the plain model's `state_dict()` keys in its order: parameters as fp32 (the
master weights under mixed precision), buffers and frozen parameters as saved (floating ones
as fp32), tied weights under each of their keys. Only the `param` slices and rank 0's raw
bytes are read, each file's checksum checked first; optimizer state is never read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from zerodist.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from zerodist.checkpoint.files import AtomicFile, RangeReader, tensor_bytes
from zerodist.checkpoint.load import _verify, choose_tag
from zerodist.checkpoint.manifest import PARAM, Manifest, is_tag_dir, read_manifest
from zerodist.checkpoint.shards import Request, fill

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def resolve_tag_dir(path: str | Path, tag: str | None = None) -> Path:
    """`path` may be a tag directory, or a save directory (then `tag`, else the newest committed)."""
    path = Path(path)
    if tag is None and is_tag_dir(path):
        return path
    chosen, error = choose_tag(path, tag)
    if error is not None:
        raise error
    if chosen is None:
        raise CheckpointNotFoundError(f"{path}: no committed checkpoint here (nor is it a checkpoint's tag directory)")
    return path / chosen


def consolidate_checkpoint(path: str | Path, tag: str | None = None, kind: str = PARAM) -> dict[str, torch.Tensor]:
    """The plain model's fp32 `state_dict()` from a checkpoint (see the module docstring).

    `kind="optimizer.exp_avg"` (any kind the manifest lists) gives that optimizer state instead,
    one full tensor per trained parameter, in the parameter's shape."""
    tag_dir = resolve_tag_dir(path, tag)
    manifest = read_manifest(tag_dir)
    lacking = [name for name, record in manifest.params.items() if kind not in record["kinds"]]
    if lacking:
        kinds = sorted({k for record in manifest.params.values() for k in record["kinds"]})
        raise CheckpointError(f"checkpoint {tag_dir}: {lacking[0]} has no {kind!r}; the kinds saved are {kinds}")
    needed = {s.file for name in manifest.params for s in manifest.slices(name, kind)[1]}
    if kind == PARAM:
        needed |= {info["file"] for info in manifest.extra.values()}
    problems = _verify(tag_dir, manifest, needed)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {tag_dir} is damaged: " + "; ".join(problems))
    reader = RangeReader(tag_dir)
    try:
        return _assemble(manifest, reader, kind)
    finally:
        reader.close()


def _assemble(manifest: Manifest, reader: RangeReader, kind: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, record in manifest.params.items():
        flat = torch.empty(_numel(record["shape"]), dtype=getattr(torch, manifest.slices(name, kind)[0]))
        fill(Request(name, kind, 0, flat.numel(), 0), flat, manifest, reader)
        tensors[name] = flat.view(record["shape"])
    if kind != PARAM:
        return tensors
    for key, info in manifest.extra.items():
        saved = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        reader.read_into(info["file"], info["offset"], saved.reshape(-1))
        tensors[key] = saved.float() if saved.is_floating_point() else saved
    state = {}
    for key in manifest.state_dict_keys:
        state[key] = tensors[manifest.aliases.get(key, key)]
    return state


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(state: dict[str, torch.Tensor], out: Path, metadata: dict[str, str] | None = None) -> None:
    """The safetensors format (8-byte header length, JSON header, raw little-endian data),
    written atomically. Tied tensors are written once per key, as safetensors has no aliasing."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, tensor in state.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: dtype {tensor.dtype} has no safetensors code")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with AtomicFile(out) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for tensor in state.values():
            if tensor.numel():
                f.write(tensor_bytes(tensor))
        f.commit()


def save_consolidated(path: str | Path, out: str | Path, tag: str | None = None, fmt: str | None = None
                      ) -> tuple[Path, Manifest, dict[str, torch.Tensor]]:
    """Consolidate and write to `out` as safetensors or torch.save (default: by the suffix:
    .pt/.pth/.bin -> torch, else safetensors). Returns (out, manifest, state)."""
    out = Path(out)
    fmt = fmt or ("torch" if out.suffix in (".pt", ".pth", ".bin") else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"format {fmt!r}: choose safetensors or torch")
    tag_dir = resolve_tag_dir(path, tag)
    manifest = read_manifest(tag_dir)
    state = consolidate_checkpoint(tag_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        write_safetensors(state, out, {"tag": manifest.tag, "global_steps": str(manifest.global_steps)})
    else:
        import io

        buffer = io.BytesIO()
        torch.save(state, buffer)
        with AtomicFile(out) as f:
            f.write(buffer.getbuffer())
            f.commit()
    return out, manifest, state
