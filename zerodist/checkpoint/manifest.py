"""The manifest: what a committed checkpoint holds and where, independent of any layout.

    save_dir/
      latest                         the newest tag (text), replaced atomically after a commit
      global_step6/
        manifest.json                written last, by rank 0: its presence *is* the commit
        shard-r00000-<save id>.bin   rank 0's raw tensor bytes
        state-r00000-<save id>.pt    rank 0's small state (RNG, data position; and rank 0 only:
                                     steps, scaler, scheduler, optimizer settings, client state)
        ...

[Note: layout-free manifest] For every parameter (by its fully-qualified name, the plain model's
`state_dict()` key) and every kind of per-element value (`param`: the fp32 values the optimizer
steps; `optimizer.exp_avg`, ...), the manifest lists slices `[start, length, file, byte offset]`
of the parameter's flattened elements. Nothing about buckets, shards, padding or stages is
recorded, so any world size and any stage can find the elements it owns, and a file name plus
an offset is all a reader needs. File names carry a per-save id, so re-saving a tag never
touches the files its committed manifest points at.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path
from typing import Any

from zerodist.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from zerodist.checkpoint.files import checksum_text, write_atomic

FORMAT = "zerodist-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
PARAM = "param"
OPTIMIZER_PREFIX = "optimizer."


@dataclasses.dataclass(frozen=True)
class Slice:
    """Elements [start, start + length) of a flattened tensor, at byte `offset` of `file`."""

    start: int
    length: int
    file: str
    offset: int


@dataclasses.dataclass
class Manifest:
    tag: str
    global_steps: int
    world_size: int
    stage: int
    precision: str
    param_dtype: str
    committed_at: float
    versions: dict[str, str]
    files: dict[str, dict[str, Any]]  # name -> {"rank", "bytes", "crc32"}
    state_files: dict[int, str]  # rank -> its state file
    params: dict[str, dict[str, Any]]  # name -> {"shape", "kinds": {kind: {"dtype", "slices"}}}
    extra: dict[str, dict[str, Any]]  # buffers, frozen params: name -> {"shape", "dtype", "file", "offset"}
    aliases: dict[str, str]  # tied weights: state_dict key -> the parameter name stored
    state_dict_keys: list[str]
    # The mesh's degrees by axis (pipe, data, expert, sequence, tensor): a rank's state file (its
    # random streams) is restored only into the same place in the same mesh. None: a checkpoint
    # from before degrees were recorded (or an import), where the world size alone decides.
    degrees: dict[str, int] | None = None

    def slices(self, name: str, kind: str) -> tuple[str, list[Slice]]:
        entry = self.params[name]["kinds"][kind]
        return entry["dtype"], [Slice(*s) for s in entry["slices"]]

    def kinds(self, name: str) -> list[str]:
        return list(self.params[name]["kinds"])

    @property
    def num_params(self) -> int:
        return sum(_numel(p["shape"]) for p in self.params.values())

    @property
    def total_bytes(self) -> int:
        return sum(f["bytes"] for f in self.files.values())

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        body["state_files"] = {str(r): f for r, f in self.state_files.items()}
        body[CHECKSUM] = _body_checksum(body)  # [Note: manifest checksum]
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointCorruptError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{where}: not a zerodist checkpoint manifest")
        if body.get("version") != VERSION:
            raise CheckpointCorruptError(f"{where}: format version {body.get('version')}; this zerodist reads "
                                         f"version {VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)}
        _check_body(body, fields, where)
        try:
            manifest = cls(**{k: v for k, v in body.items() if k in fields})
        except TypeError as err:
            raise CheckpointCorruptError(f"{where}: incomplete manifest ({err})") from None
        manifest.state_files = {int(r): f for r, f in manifest.state_files.items()}
        return manifest


# [Note: manifest checksum] Every data file's CRC-32 is in the manifest; the manifest's own is in
# its "checksum" key: the CRC-32 of the JSON text of every other key, as `json.dumps(body,
# indent=1)` writes it (JSON of Python values reads back to the same values, so the reader
# re-serialises what it parsed and compares). A changed offset that is still valid JSON (4 bytes
# shifted: a silently wrong resume) is thus caught. Manifests of zerodist versions before the
# checksum have no such key and are read as before; any key the format does not know, as a
# damaged "checksum" key's name would be, is damage.
CHECKSUM = "checksum"
_HEADER_KEYS = frozenset({"format", "version"})


def _body_checksum(body: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in body.items() if k != CHECKSUM}, indent=1)
    return checksum_text(zlib.crc32(text.encode("utf-8")))


def _check_body(body: dict[str, Any], fields: set[str], where: Path) -> None:
    unknown = sorted(set(body) - fields - _HEADER_KEYS - {CHECKSUM})
    if unknown:
        raise CheckpointCorruptError(f"{where}: damaged, unknown key(s) {unknown}")
    expected = body.get(CHECKSUM)
    if expected is not None and _body_checksum(body) != expected:
        raise CheckpointCorruptError(f"{where}: damaged, CRC-32 {_body_checksum(body)} instead of {expected} "
                                     "(the manifest was changed after it was written)")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_manifest(tag_dir: Path) -> Manifest:
    path = Path(tag_dir) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{tag_dir}: no {MANIFEST}, so no committed checkpoint (a save that did "
                                      "not finish leaves this)") from None
    return Manifest.from_json(text, path)


def write_manifest(tag_dir: Path, manifest: Manifest) -> None:
    write_atomic(Path(tag_dir) / MANIFEST, manifest.to_json().encode("utf-8"), points="manifest")


def write_latest(save_dir: Path, tag: str) -> None:
    write_atomic(Path(save_dir) / LATEST, tag.encode("utf-8"), points="latest")


def read_latest(save_dir: Path) -> str | None:
    try:
        return (Path(save_dir) / LATEST).read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclasses.dataclass
class Listing:
    """The tags under a save directory: committed (oldest first) and incomplete (with why)."""

    committed: list[Manifest]
    incomplete: dict[str, str]  # tag -> why it is not loadable (no manifest, or a damaged one)
    latest: str | None
    damaged: dict[str, float] = dataclasses.field(default_factory=dict)  # tag -> its damaged manifest's mtime

    def newest(self) -> Manifest | None:
        return self.committed[-1] if self.committed else None

    def find(self, tag: str) -> Manifest | None:
        return next((m for m in self.committed if m.tag == tag), None)


def list_checkpoints(save_dir: Path) -> Listing:
    """Every tag directory under `save_dir`; a tag is committed when its manifest reads back."""
    save_dir = Path(save_dir)
    committed, incomplete, damaged = [], {}, {}
    try:
        entries = sorted(os.scandir(save_dir), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        try:
            committed.append(read_manifest(Path(entry.path)))
        except CheckpointNotFoundError:
            incomplete[entry.name] = f"no {MANIFEST} (a save that did not finish)"
        except CheckpointCorruptError as err:
            incomplete[entry.name] = str(err)
            damaged[entry.name] = _mtime(Path(entry.path) / MANIFEST)
    committed.sort(key=lambda m: (m.global_steps, m.committed_at))
    return Listing(committed, incomplete, read_latest(save_dir), damaged)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def is_tag_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_tag_name(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", LATEST) or tag.startswith(".") or "/" in tag or os.sep in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (not '{LATEST}', no '/', no "
                         "leading '.')")
    return tag
