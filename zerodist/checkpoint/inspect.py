"""What `zerodist checkpoint inspect` reports: each tag's step, shape of the run, size, integrity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from zerodist.checkpoint.files import file_problem
from zerodist.checkpoint.manifest import is_tag_dir, list_checkpoints, read_manifest


@dataclasses.dataclass(frozen=True)
class TagReport:
    tag: str
    committed: bool
    global_steps: int | None = None
    world_size: int | None = None
    stage: int | None = None
    precision: str | None = None
    num_params: int | None = None
    num_files: int | None = None
    total_bytes: int | None = None
    problems: tuple[str, ...] = ()
    note: str = ""  # why a tag is not committed


def inspect_checkpoints(path: str | Path, verify: bool = True) -> tuple[list[TagReport], str | None]:
    """One report per tag under a save directory (or for one tag directory), oldest first, and
    the tag `latest` names. `verify` re-reads every file and checks its size and checksum."""
    path = Path(path)
    if is_tag_dir(path):
        manifests, incomplete, damaged, latest = [read_manifest(path)], {}, {}, None
        base = path.parent
    else:
        listing = list_checkpoints(path)
        manifests, incomplete, latest, base = listing.committed, listing.incomplete, listing.latest, path
        damaged = listing.damaged
    reports = []
    for m in manifests:
        problems: list[str] = []
        if verify:
            for name, info in sorted(m.files.items()):
                problem = file_problem(base / m.tag / name, info["bytes"], info["crc32"])
                if problem:
                    problems.append(problem)
        reports.append(TagReport(m.tag, True, m.global_steps, m.world_size, m.stage, m.precision, m.num_params,
                                 len(m.files), m.total_bytes, tuple(problems)))
    # A damaged manifest is a problem (inspect exits 1), a missing one an unfinished save.
    reports += [TagReport(tag, False, problems=(why,)) if tag in damaged else TagReport(tag, False, note=why)
                for tag, why in incomplete.items()]
    return reports, latest
