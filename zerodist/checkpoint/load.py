"""`load_checkpoint`: any committed checkpoint into an engine of any world size and ZeRO stage.

    rank 0 picks the tag (skipping uncommitted ones, with a warning naming each) -> every rank
    checks the files it will read against the manifest's sizes and checksums, and the ranks
    agree on the result -> each rank copies the elements it owns -> optimizer, scheduler,
    scaler, steps; each rank's RNG too when the layout (world size and mesh) is the one saved

Same layout and stage: training continues bitwise as if it had never stopped. Another world
size, mesh (pipe, data, expert, sequence, tensor degrees) or stage: parameters and optimizer
state are exact (they are elementwise); the continued run matches the uninterrupted one to fp32
rounding (reductions add in another order).
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.checkpoint.deepspeed_import import DeepSpeedImportError, agreed_tag_dir, import_deepspeed
from zerodist.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from zerodist.checkpoint.files import RangeReader, file_problem, read_verified
from zerodist.checkpoint.manifest import Manifest, list_checkpoints, read_manifest
from zerodist.checkpoint.shards import check_parameters, files_needed, load_groups
from zerodist.checkpoint.state import group_mapping, remap_scheduler_state, restore_optimizer
from zerodist.comm.domains import logical_keys
from zerodist.comm.slices import ParamSlicing, param_slicings
from zerodist.utils import get_logger, log_rank0
from zerodist.zero.flat_group import FlatParamGroup, ParamState
from zerodist.zero.registry import GatheredParameters
from zerodist.zero.state import Resumable, ZeroState

logger = get_logger(__name__)


def choose_tag(load_dir: Path, tag: Any, skip_damaged: bool = False) -> tuple[str | None, CheckpointError | None]:
    """(tag to load or None, error) for `load_dir`; warns about every uncommitted tag.

    A damaged manifest newer than the newest intact checkpoint is an error naming both, unless
    `skip_damaged` (then a warning, and the intact one loads): a silent fall-back would train
    on from an older step than the user believes. An older damaged one is only warned about."""
    listing = list_checkpoints(load_dir)
    committed = [m.tag for m in listing.committed]
    if tag is not None:
        if listing.find(str(tag)) is None:
            why = listing.incomplete.get(str(tag), "no such tag")
            kind = CheckpointCorruptError if str(tag) in listing.damaged else CheckpointNotFoundError
            return None, kind(f"no committed checkpoint {str(tag)!r} in {load_dir} ({why}); committed tags: "
                              f"{', '.join(committed) or 'none'}")
        return str(tag), None
    newest = max(listing.committed, key=lambda m: m.committed_at, default=None)
    blocking = _damaged_after(listing, newest)
    if blocking and not skip_damaged:
        return None, CheckpointCorruptError(_damaged_message(load_dir, listing, blocking, newest))
    for name, why in listing.incomplete.items():
        logger.warning("skipping checkpoint %s in %s: %s", name, load_dir, why)
    if listing.latest is not None and newest is not None and listing.latest != newest.tag:
        named = listing.find(listing.latest)
        if named is not None:
            logger.warning("%s/latest names %s, but %s was committed after it (a save interrupted before updating "
                           "latest); loading %s", load_dir, listing.latest, newest.tag, newest.tag)
        else:
            logger.warning("%s/latest names %s, which is not a committed checkpoint (%s); loading the newest "
                           "committed one, %s", load_dir, listing.latest,
                           listing.incomplete.get(listing.latest, "no such tag"), newest.tag)
    return (newest.tag if newest else None), None


def _damaged_after(listing: Any, newest: Manifest | None) -> list[str]:
    """The damaged tags that may be newer than `newest`: `latest` names it, its step (from a
    `global_stepN` name) is higher, or, without a step in its name, its manifest changed later."""
    found = []
    for tag, mtime in listing.damaged.items():
        step = tag.removeprefix("global_step")
        if newest is None or tag == listing.latest:
            found.append(tag)
        elif step.isdigit():
            if int(step) > newest.global_steps:
                found.append(tag)
        elif mtime > newest.committed_at:
            found.append(tag)
    return found


def _damaged_message(load_dir: Path, listing: Any, damaged: list[str], newest: Manifest | None) -> str:
    return _damage_report(load_dir, [(tag, listing.incomplete[tag]) for tag in damaged], newest)


def _damage_report(load_dir: Path, damaged: list[tuple[str, str]], newest: Manifest | None) -> str:
    """The error for a damaged newest checkpoint (its manifest or its files): what is damaged, the
    newest intact tag and the ways to resume from it."""
    lines = [f"the newest checkpoint in {load_dir} is damaged; nothing was loaded:"]
    lines += [f"  {tag}: {why}" for tag, why in damaged]
    if newest is None:
        lines.append("No intact checkpoint is left to resume from.")
    else:
        lines.append(f"The newest intact checkpoint is {newest.tag} (step {newest.global_steps}). To resume from it, "
                     f"pass tag={newest.tag!r} to load_checkpoint, or set checkpoint.skip_damaged: true in the config; "
                     "or move the damaged tag away.")
    return "\n".join(lines)


def _verify(tag_dir: Path, manifest: Manifest, names: set[str]) -> list[str]:
    problems = []
    for name in sorted(names):
        info = manifest.files.get(name)
        if info is None:
            problems.append(f"{tag_dir / name}: not listed in the manifest")
            continue
        problem = file_problem(tag_dir / name, info["bytes"], info["crc32"])
        if problem:
            problems.append(problem)
    return problems


def _read_state(tag_dir: Path, manifest: Manifest, rank: int) -> dict[str, Any]:
    name = manifest.state_files[rank]
    info = manifest.files[name]
    data = read_verified(tag_dir / name, info["bytes"], info["crc32"])
    # Our own file, its checksum just verified; it holds Python objects (RNG states, client state).
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def check_extra(module: torch.nn.Module, manifest: Manifest, slicings: Mapping[int, ParamSlicing]) -> None:
    """Every saved buffer and frozen parameter this model holds has the model's logical shape; raised
    on every rank together, before anything is loaded. Collective (one exchange, which also finds the
    saved keys no rank's model has: logged, as another rank may hold an expert this one does not)."""
    logical = logical_keys(module)
    live = {logical[key]: value for key, value in module.state_dict(keep_vars=True).items()}
    mine = []
    for key, value in live.items():
        info = manifest.extra.get(key)
        slicing = slicings.get(id(value))
        shape = slicing.logical_shape if slicing is not None else tuple(value.shape)
        if info is None or tuple(info["shape"]) == shape:
            continue
        problem = f"{key} is saved with shape {tuple(info['shape'])}, this model's is {shape}"
        if slicing is not None and tuple(info["shape"]) == slicing.local_shape:
            problem += (" (zerodist before 2026-11-28 wrote a frozen parameter that tensor parallelism slices as "
                        "its first slice only: its other slices were never written, so this checkpoint cannot "
                        "restore it at any degree)")
        mine.append(problem)
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, (mine, [k for k in manifest.extra if k not in live]))
    problems = sorted({problem for found, _ in everyone for problem in found})
    if problems:
        raise CheckpointError(f"checkpoint {manifest.tag} does not fit this model: {'; '.join(problems)}")
    missing = [k for k in manifest.extra if all(k in keys for _, keys in everyone)]
    if missing:
        log_rank0(logger, "checkpoint %s holds %s, which this model does not have; ignored", manifest.tag, missing,
                  level=30)


@torch.no_grad()
def load_extra(module: torch.nn.Module, manifest: Manifest, reader: RangeReader,
               frozen_groups: Sequence[FlatParamGroup] = (), slicings: Mapping[int, ParamSlicing] | None = None
               ) -> None:
    """Buffers and frozen parameters, each stored whole once, by logical key (`check_extra` has
    checked their shapes and named the saved keys no rank holds). A frozen parameter that tensor parallelism slices (`slicings`, by id) takes this rank's slice of
    the saved logical value, and a sharded one (`frozen_groups`: [Note: frozen parameters at stage
    3] in zero/apply.py) this rank's shard of that."""
    slicings = slicings or {}
    sharded = {id(p): (group, index) for group in frozen_groups for index, p in enumerate(group.params)}
    taken: dict[int, dict[int, torch.Tensor]] = {}  # id(group) -> layout index -> saved value
    logical = logical_keys(module)
    live = {logical[key]: value for key, value in module.state_dict(keep_vars=True).items()}
    for key, info in manifest.extra.items():
        if key not in live:
            continue
        saved = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        reader.read_into(info["file"], info["offset"], saved.reshape(-1))
        slicing = slicings.get(id(live[key]))
        if slicing is not None:
            saved = slicing.cut(saved)
        if id(live[key]) in sharded:
            group, index = sharded[id(live[key])]
            taken.setdefault(id(group), {})[index] = saved
        else:
            live[key].data.copy_(saved)
    for group in frozen_groups:
        values = taken.get(id(group), {})
        if len(values) == len(group.params) and group.state is ParamState.SHARDED:
            group.load_full_values([values[i] for i in range(len(group.params))])
        elif values:  # gathered now, or some saved and some not (the model keeps its own for those)
            with GatheredParameters(group.params, modifier_rank=0):
                for index, value in values.items():
                    group.params[index].data.copy_(value)


def training_state(zero: ZeroState, manifest: Manifest, common: dict[str, Any], own: dict[str, Any] | None,
                   load_lr_scheduler_states: bool) -> dict[str, Any]:
    """The training state to hand to `load_training_state_dict`: the saved counters and scaler,
    the scheduler's state remapped onto this engine's param groups ([Note: param groups by name]),
    and this rank's RNG streams and data position when the layout is the one saved (rank 0's
    data position otherwise)."""
    state = {key: common[key] for key in ("global_steps", "micro_steps", "skipped_steps", "loss_scaler")}
    state["gradient_accumulation_steps"] = common.get("gradient_accumulation_steps")  # absent in older checkpoints
    saved_scheduler = common["lr_scheduler"]
    if load_lr_scheduler_states and saved_scheduler is not None:
        saved = common["optimizer"]
        mapping = group_mapping(zero.groups, zero.inner_optimizer, saved)
        state["lr_scheduler"] = remap_scheduler_state(saved_scheduler, mapping, len(saved["options"]))
    source = own if own is not None else common.get("rank0")
    state["data"] = source.get("data") if source is not None else None
    state["rng"] = own["rng"] if own is not None else None  # None too when imported from DeepSpeed (no RNG saved)
    if state["rng"] is None:
        log_rank0(logger, "checkpoint %s (saved by %d rank(s)%s) has no random number streams for this run's %d "
                  "rank(s)%s: they start afresh (parameters, optimizer and data position are restored)", manifest.tag,
                  manifest.world_size, _mesh(manifest.degrees), comm.get_world_size(), _mesh(zero.topology.degrees))
    return state


def _axes(degrees: Any) -> dict[str, int]:
    """The axes of degree > 1 (an axis of degree 1 changes no rank's place)."""
    return {axis: n for axis, n in (degrees or {}).items() if n > 1}


def _mesh(degrees: Any) -> str:
    """' as pipe 2 x tensor 2', '' when unknown or every degree is 1."""
    named = [f"{axis} {n}" for axis, n in _axes(degrees).items()]
    return f" as {' x '.join(named)}" if named else ""


def own_state_file(zero: ZeroState, manifest: Manifest) -> bool:
    """Whether this rank's saved state file (its random streams: torch's, and each technique's such
    as tensor parallelism's, seeded by the rank's place in the mesh) is its own: the same world
    size and, where the manifest records it, the same mesh. Another layout of as many ranks puts
    rank r elsewhere in the mesh (pipe 2 x tensor 2 -> tensor 4: saved tensor rank 0 would
    become tensor rank 2, sharing rank 0's dropout masks), so its streams start afresh as at another
    world size."""
    if manifest.world_size != comm.get_world_size():
        return False
    if manifest.degrees is None:  # saved before degrees were recorded
        return True
    return _axes(manifest.degrees) == _axes(zero.topology.degrees)


def _all_shapes(zero: ZeroState) -> dict[str, tuple[int, ...]]:
    """Logical name -> logical shape of the trained parameters of every rank (collective): a rank
    holding some experts or a slice knows only its own."""
    mine = {r.name: r.global_shape for g in zero.groups for r in g.records}
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, mine)
    return {name: tuple(shape) for shapes in everyone for name, shape in shapes.items()}


def _pick(load_dir: Path, tag: Any, skip_damaged: bool) -> Manifest | None:
    """Rank 0 chooses and reads the manifest; every rank gets the same (never different tags),
    or raises the same error."""
    def choose() -> tuple[str | None, CheckpointError | None]:
        return choose_tag(load_dir, tag, skip_damaged)

    return _read_on_rank0(load_dir, choose)


def _older(load_dir: Path, than: Manifest) -> Manifest | None:
    """The committed checkpoint before `than` (rank 0 reads it, every rank gets it)."""
    def choose() -> tuple[str | None, CheckpointError | None]:
        older = sorted((m for m in list_checkpoints(load_dir).committed if m.committed_at < than.committed_at),
                       key=lambda m: m.committed_at)
        return (older[-1].tag if older else None), None

    return _read_on_rank0(load_dir, choose)


def _read_on_rank0(load_dir: Path, choose: Callable[[], tuple[str | None, CheckpointError | None]]
                   ) -> Manifest | None:
    """Rank 0 picks a tag with `choose()` and reads its manifest; every rank returns the same manifest
    (None when there is none) or raises the same error."""
    choice: list[Any] = [None]
    if comm.get_rank() == 0:
        chosen, error = choose()
        try:
            choice[0] = (read_manifest(load_dir / chosen) if chosen else None, error)
        except CheckpointError as err:
            choice[0] = (None, err)
    comm.broadcast_object_list(choice, src=0)
    manifest, error = choice[0]
    if error is not None:
        raise error
    return manifest


def _needed(zero: ZeroState, manifest: Manifest, with_optimizer: bool) -> set[str]:
    needed = files_needed(zero.groups, manifest, with_optimizer) | {i["file"] for i in manifest.extra.values()}
    own = own_state_file(zero, manifest)
    return needed | {manifest.state_files[0]} | ({manifest.state_files[comm.get_rank()]} if own else set())


def _agreed_problems(zero: ZeroState, load_dir: Path, manifest: Manifest, with_optimizer: bool) -> list[str]:
    """Every rank's problems with the files it would read of `manifest`, the same list on every rank."""
    problems: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(problems, _verify(load_dir / manifest.tag, manifest, _needed(zero, manifest, with_optimizer)))
    return sorted({p for ps in problems for p in ps})


def _pick_intact(zero: ZeroState, load_dir: Path, tag: Any, skip_damaged: bool,
                 with_optimizer: bool) -> Manifest | None:
    """The manifest to load, its files verified on every rank. A tag asked for by name loads or fails;
    the newest one, when its files are damaged, gives way to the newest intact one only with
    `skip_damaged` (one warning line), else it is an error naming both, as for a damaged manifest."""
    manifest = _pick(load_dir, tag, skip_damaged)
    damaged: list[tuple[str, str]] = []
    while manifest is not None:
        check_parameters(_all_shapes(zero), manifest)
        found = _agreed_problems(zero, load_dir, manifest, with_optimizer)
        if not found:
            break
        if tag is not None:
            raise CheckpointCorruptError(f"checkpoint {load_dir / manifest.tag} is damaged; nothing was loaded: "
                                         + "; ".join(found))
        damaged.append((manifest.tag, "; ".join(found)))
        manifest = _older(load_dir, manifest)
    if damaged and (manifest is None or not skip_damaged):
        raise CheckpointCorruptError(_damage_report(load_dir, damaged, manifest))
    if damaged and manifest is not None:
        log_rank0(logger, "checkpoint.skip_damaged: loading %s (step %d), the newest intact checkpoint in %s; damaged "
                  "and skipped: %s", manifest.tag, manifest.global_steps, load_dir,
                  "; ".join(f"{t} ({why})" for t, why in damaged), level=30)
    return manifest


def load_checkpoint(zero: ZeroState, resumable: Resumable, load_dir: str | Path, tag: Any = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, skip_damaged: bool = False) -> tuple[str | None, Any]:
    """Load `load_dir/tag` (default: the most recently committed) into the ZeRO state `zero` and,
    unless `load_module_only`, the training state of `resumable` (collective).

    Returns `(checkpoint directory, client_state)`, or `(None, None)` when `load_dir` holds no
    committed checkpoint (as DeepSpeed does). A damaged newest checkpoint is an error naming the
    newest intact one, which `skip_damaged=True` (or that tag) loads instead."""
    load_dir = Path(load_dir).absolute()
    deepspeed_dir = agreed_tag_dir(load_dir, tag)
    if deepspeed_dir is not None:  # DeepSpeed's files: converted, then loaded as ours
        return load_deepspeed_checkpoint(zero, resumable, deepspeed_dir, load_optimizer_states=load_optimizer_states,
                                         load_lr_scheduler_states=load_lr_scheduler_states,
                                         load_module_only=load_module_only)
    with_optimizer = load_optimizer_states and not load_module_only
    manifest = _pick_intact(zero, load_dir, tag, skip_damaged, with_optimizer)
    if manifest is None:
        log_rank0(logger, "no committed checkpoint in %s; nothing loaded", load_dir, level=30)
        return None, None
    tag_dir = load_dir / manifest.tag
    rank, world = comm.get_rank(), comm.get_world_size()
    own_file = own_state_file(zero, manifest)
    reader = RangeReader(tag_dir)
    slicings = param_slicings(zero.module, zero.topology)
    check_extra(zero.module, manifest, slicings)
    try:
        elementwise = load_groups(zero.groups, manifest, reader, with_optimizer)
        load_extra(zero.module, manifest, reader, zero.frozen_groups, slicings)
    finally:
        reader.close()
    rank0 = _read_state(tag_dir, manifest, 0)
    common = rank0["common"]
    common["rank0"] = rank0
    if with_optimizer:
        restore_optimizer(zero.groups, zero.inner_optimizer, common["optimizer"], elementwise)
    if not load_module_only:
        own = (rank0 if rank == 0 else _read_state(tag_dir, manifest, rank)) if own_file else None
        resumable.load_training_state_dict(training_state(zero, manifest, common, own, load_lr_scheduler_states))
    log_rank0(logger, "loaded checkpoint %s (step %d, saved by %d rank(s) at ZeRO stage %d) into %d rank(s) at "
              "stage %d", tag_dir, manifest.global_steps, manifest.world_size, manifest.stage, world, zero.sharding.stage)
    return str(tag_dir), common["client_state"]


def load_deepspeed_checkpoint(zero: ZeroState, resumable: Resumable, tag_dir: Path, **load_options: Any) -> tuple[str, Any]:
    """Collective: every rank converts `tag_dir` into its own temporary directory (the same bytes
    on every rank), the ranks agree that all succeeded, then the ordinary load reshards it into
    the ZeRO state `zero` and the training state of `resumable` (see `load_checkpoint`). Returns
    `(tag_dir, client_state)` as `load_checkpoint` does."""
    with tempfile.TemporaryDirectory(prefix="zerodist-deepspeed-import-") as scratch:
        error: Exception | None = None
        try:
            _, state = import_deepspeed(tag_dir, scratch)
        except Exception as err:  # reported to every rank first, so none waits in the gather below
            error = err
        outcomes: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
        if failed:
            raise DeepSpeedImportError(f"rank {failed[0][0]} could not import {tag_dir}: {failed[0][1]}")
        log_rank0(logger, "importing DeepSpeed checkpoint %s (%s)", tag_dir, state.source)
        _, client_state = load_checkpoint(zero, resumable, scratch, **load_options)
    return str(tag_dir), client_state


def latest_tag(load_dir: str | Path) -> str | None:
    """The tag `load_checkpoint(load_dir)` would load (no collective; for tools and tests)."""
    tag, error = choose_tag(Path(load_dir), None)
    if error is not None:
        raise error
    return tag
