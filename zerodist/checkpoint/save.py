"""`save_checkpoint`: every rank writes its shard, rank 0 commits the manifest, then `latest`.

    agree on the tag (store, with a deadline) -> each rank: shard file + state file, each atomic
    -> gather every rank's report on rank 0 -> rank 0: manifest (the commit), `latest`, clean-up
    -> rank 0 tells every rank the outcome -> every rank returns, or raises the same error

A crash anywhere before the manifest's rename leaves the tag uncommitted (loads skip it, and
the previous checkpoint is untouched); after it, the new checkpoint is complete. A rank that
fails to write (no space, no permission) still reports to rank 0, so the error reaches every
rank and nothing is committed, instead of the other ranks waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import zerodist
import zerodist.comm as comm
from zerodist.checkpoint.errors import CheckpointAgreementError, CheckpointError, CheckpointWriteError
from zerodist.checkpoint.files import AtomicFile, kill_point, tensor_bytes, write_atomic
from zerodist.checkpoint.manifest import (MANIFEST, Manifest, check_tag_name, list_checkpoints, write_latest,
                                          write_manifest)
from zerodist.checkpoint.shards import collect_chunks, collect_scalars
from zerodist.comm.domains import logical_keys, parameter_placements
from zerodist.comm.slices import ParamSlicing, param_slicings
from zerodist.config import CheckpointConfig
from zerodist.utils import get_logger, log_rank0
from zerodist.zero.registry import GatheredParameters
from zerodist.zero.state import Resumable, ZeroState

logger = get_logger(__name__)
DEFAULT_AGREEMENT_TIMEOUT_S = 1800.0  # torch's default collective timeout


@dataclasses.dataclass
class RankReport:
    """What one rank wrote (or why it could not), sent to rank 0."""

    rank: int
    files: dict[str, dict[str, Any]]
    pieces: list[tuple[str, str, str, int, int, str, int]]  # name, kind, dtype, start, length, file, offset
    error: str | None = None
    common: dict[str, Any] | None = None  # every rank: its state_dict keys, aliases and extra tensors, by logical key
    params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # logical name -> shape, placement


def agreement_timeout(settings: CheckpointConfig) -> float:
    timeout = getattr(settings, "agreement_timeout", None)
    if timeout:
        return float(timeout)
    return comm.ensure_initialized().timeout_s or DEFAULT_AGREEMENT_TIMEOUT_S


def agree_on_tag(settings: CheckpointConfig, tag: str, save_dir: Path, global_steps: int) -> tuple[str, str]:
    """Every rank must be saving now; returns the tag and save id every rank uses (rank 0's)."""
    mine = json.dumps({"tag": tag, "step": global_steps, "id": uuid.uuid4().hex[:12], "dir": str(save_dir)})
    timeout = agreement_timeout(settings)
    try:
        everyone = [json.loads(v) for v in comm.exchange_with_deadline("checkpoint-save", mine, timeout)]
    except comm.ExchangeTimeoutError as err:
        raise CheckpointAgreementError(
            f"save_checkpoint(tag={tag!r}) on rank {comm.get_rank()}: {err}. Every rank must call save_checkpoint "
            "at the same point (it is collective); nothing was written") from None
    tags = {d["tag"] for d in everyone}
    if len(tags) > 1:
        listed = ", ".join(f"rank {r}: {d['tag']!r}" for r, d in enumerate(everyone))
        policy = settings.tag_validation
        if policy == "Fail":
            raise CheckpointAgreementError(f"save_checkpoint: the ranks passed different tags ({listed}); "
                                           "checkpoint.tag_validation is Fail")
        if policy == "Warn":
            log_rank0(logger, "save_checkpoint: the ranks passed different tags (%s); saving under rank 0's %r",
                      listed, everyone[0]["tag"], level=30)
    return everyone[0]["tag"], everyone[0]["id"]


def _module_facts(zero: ZeroState, frozen: dict[int, torch.Tensor | None]
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor | None]]:
    """This rank's state-dict keys, tied-weight aliases and the tensors outside the flat groups
    (buffers, frozen parameters), all by logical key ([Note: logical names] in comm/domains.py).
    `frozen`: the whole values of the frozen parameters that are sharded or sliced (`frozen_values`);
    None where another rank writes them."""
    canonical = {id(r.param): r.name for g in zero.groups for r in g.records}
    logical = logical_keys(zero.module)
    keys, aliases, extra = [], {}, {}
    for physical, value in zero.module.state_dict(keep_vars=True).items():
        key = logical[physical]
        keys.append(key)
        if id(value) in canonical:
            if canonical[id(value)] != key:
                aliases[key] = canonical[id(value)]
        elif id(value) in frozen:
            extra[key] = frozen[id(value)]
        elif value.device.type == "meta":
            raise CheckpointError(f"save_checkpoint: {physical} has no values on this rank (a meta tensor)")
        else:
            extra[key] = value.detach()
    return {"state_dict_keys": keys, "aliases": aliases}, extra


def frozen_values(zero: ZeroState) -> tuple[dict[int, torch.Tensor | None], Exception | None]:
    """id(param) -> the whole (logical) value of each parameter outside the trained groups that
    needs a collective to be whole: a sharded frozen parameter (stage 3), a frozen parameter that
    tensor parallelism slices, or both. Copied to the host by the one rank that writes it, None on
    the others; and the error a copy raised on this rank (None: none). Collective: every rank takes
    part in every gather even when its copy failed, and the failure is raised on every rank by
    `gather_facts`' exchange ([Note: frozen parameters at stage 3] in zero/apply.py).

    One rank copies each value: among the ranks holding the same values (after the join), the
    first of every axis the parameter is replicated over but not reduced over (`tensor` for a dense
    one), of a sliced one's slice axis and of MiCS's replicas, and there the rank of its reduce axes
    that has copied the fewest bytes so far (the same choice on every rank: the groups and their
    sizes are), so a rank holds about 1/N of the frozen model on the host while saving, not all of
    it (a LoRA run's base model). Sharded groups are gathered one at a time."""
    topology = zero.topology
    slicings = param_slicings(zero.module, topology)
    placements = parameter_placements(zero.module)
    values: dict[int, torch.Tensor | None] = {}
    failure: list[Exception] = []
    copied: dict[tuple[int, ...], list[int]] = {}  # ranks that hold the same values -> bytes each copies

    def writer(ranks: tuple[int, ...], nbytes: int) -> int:
        load = copied.setdefault(ranks, [0] * len(ranks))
        index = load.index(min(load))
        load[index] += nbytes
        return ranks[index]

    def first_along(axes: tuple[str, ...]) -> bool:
        return not axes or topology.axis_rank(*axes) == 0

    def keep(param: torch.Tensor, whole: torch.Tensor, writes: bool) -> None:
        values[id(param)] = None
        if writes and not failure:
            try:
                values[id(param)] = whole.to("cpu", copy=True)
            except Exception as err:  # host memory: raised on every rank by gather_facts
                failure.append(err)

    for group in zero.frozen_groups:
        domain = group.domain_group
        chosen = writer(domain.ranks, sum(p.numel() * p.element_size() for p in group.params))
        first_replica = domain.replica_group is None or comm.get_rank(domain.replica_group) == 0
        with GatheredParameters(group.params):
            for param in group.params:
                slicing = slicings.get(id(param))
                writes = (comm.get_rank() == chosen and first_replica and first_along(domain.domain.norm_axes)
                          and (slicing is None or slicing.rank == 0))
                keep(param, _joined(param, slicing, zero), writes)
    trained = {id(r.param) for g in zero.groups for r in g.records}
    for param in zero.module.parameters():  # the same order on every rank of a slice axis
        slicing = slicings.get(id(param))
        if slicing is None or id(param) in trained or id(param) in values:
            continue
        where = placements[id(param)].domain
        chosen = writer(tuple(topology.ranks(*where.reduce_axes)), param.numel() * param.element_size())
        writes = comm.get_rank() == chosen and first_along(where.norm_axes) and slicing.rank == 0
        keep(param, _joined(param, slicing, zero), writes)
    return values, (failure[0] if failure else None)


def _joined(param: torch.Tensor, slicing: ParamSlicing | None, zero: ZeroState) -> torch.Tensor:
    """`param`'s logical value: itself, or its slices joined over their axis (collective)."""
    return param.detach() if slicing is None else slicing.gather(param, zero.topology)


def _rank_state(training: dict[str, Any], scalars: dict[str, Any] | None, client_state: Any,
                rank: int) -> dict[str, Any]:
    """This rank's state file: its RNG and data position; rank 0 also the model-wide state
    (`scalars`: every rank's optimizer settings, merged)."""
    state: dict[str, Any] = {"rank": rank, "rng": training.get("rng"), "data": training.get("data")}
    if rank == 0:
        state["common"] = {
            **{key: training[key] for key in ("global_steps", "micro_steps", "skipped_steps",
                                              "gradient_accumulation_steps")},
            "loss_scaler": training.get("loss_scaler"), "lr_scheduler": training.get("lr_scheduler"),
            "optimizer": scalars, "client_state": client_state,
        }
    return state


def gather_facts(zero: ZeroState) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """What only some ranks know (a rank holding some experts, or a slice, alone knows their
    names), exchanged in one collective: every rank's optimizer settings merged (rank 0 stores
    them), this rank's module facts, and the extra tensors this rank writes: those whose logical
    key no lower rank holds, so each is written once (a sharded or sliced frozen parameter is held,
    whole, by the one rank that copied it: `frozen_values`)."""
    frozen, failure = frozen_values(zero)
    try:  # reads swapped optimizer state: a damaged swap file fails here ([Note: swap checksums])
        if failure is not None:
            raise failure
        scalars = collect_scalars(zero.written_groups(), zero.inner_optimizer)
        facts, extra = _module_facts(zero, frozen)
        mine: Any = (scalars, [key for key, tensor in extra.items() if tensor is not None])
    except Exception as err:  # every rank must reach the exchange, then all fail together
        failure = err
        mine = f"rank {comm.get_rank()}: {err}" if isinstance(err, CheckpointError) else \
            f"rank {comm.get_rank()}: {type(err).__name__}: {err}"
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, mine)
    errors = [e for e in everyone if isinstance(e, str)]
    if errors:
        raise CheckpointWriteError("save_checkpoint failed and committed nothing: " + "; ".join(errors)) from failure
    merged = everyone[0][0]
    for other, _ in everyone[1:]:
        merged["group_of"].update(other["group_of"])
        merged["scalars"].update(other["scalars"])
    lower = {key for _, keys in everyone[: comm.get_rank()] for key in keys}
    held = {key for _, keys in everyone for key in keys}
    # each frozen parameter this rank did not copy, another rank of its domain group did
    assert all(key in held for key, t in extra.items() if t is None), "a frozen parameter to write was not copied"
    return merged, facts, {key: t for key, t in extra.items() if key not in lower and t is not None}


def write_rank_files(zero: ZeroState, training: dict[str, Any], facts: tuple[dict[str, Any], dict[str, Any], dict[
                     str, torch.Tensor]], tag_dir: Path, save_id: str, rank: int, client_state: Any) -> RankReport:
    """This rank's shard (raw tensor bytes) and state file, each written atomically."""
    chunks, pieces = collect_chunks(zero.written_groups(), zero.inner_optimizer.state)
    scalars, common, extra = facts
    shard_name, state_name = f"shard-r{rank:05d}-{save_id}.bin", f"state-r{rank:05d}-{save_id}.pt"
    report = RankReport(rank, {}, [], common=common, params=zero.param_facts())
    tag_dir.mkdir(parents=True, exist_ok=True)
    with AtomicFile(tag_dir / shard_name, points="shard") as out:
        kill_point("shard-opened")
        offsets = []
        for number, (_, tensor) in enumerate(chunks):
            offsets.append(out.write(tensor_bytes(tensor)))
            if number == 0:
                kill_point("shard-partial")
        common["extra"] = {key: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                 "file": shard_name, "offset": out.write(tensor_bytes(t))}
                           for key, t in extra.items()}
        out.commit()
    report.files[shard_name] = {"rank": rank, "bytes": out.nbytes, "crc32": out.checksum}
    for p in pieces:
        tensor = chunks[p.chunk][1]
        dtype = str(tensor.dtype).removeprefix("torch.")
        report.pieces.append((p.name, p.kind, dtype, p.start, p.length, shard_name,
                              offsets[p.chunk] + p.at * tensor.element_size()))
    buffer = io.BytesIO()
    torch.save(_rank_state(training, scalars, client_state, rank), buffer)
    nbytes, checksum = write_atomic(tag_dir / state_name, buffer.getvalue(), points="state")
    report.files[state_name] = {"rank": rank, "bytes": nbytes, "crc32": checksum, "state": True}
    return report


def merge_params(reports: list[RankReport]) -> dict[str, dict[str, Any]]:
    """Every rank's parameters by logical name: its logical shape and placement, which every rank
    holding (a part of) it must state alike."""
    params: dict[str, dict[str, Any]] = {}
    for report in reports:
        for name, facts in report.params.items():
            logical = dict(facts, shape=_logical_shape(facts))
            known = params.setdefault(name, {**logical, "kinds": {}})
            if known["shape"] != logical["shape"] or known["placement"]["slice_dim"] != logical["placement"]["slice_dim"]:
                raise CheckpointError(f"internal: ranks disagree on the shape or slicing of {name}: {known['shape']} "
                                      f"and {logical['shape']}")
    for entry in params.values():
        entry["placement"] = {k: v for k, v in entry["placement"].items() if k != "part"}  # the rank's own
    return params


def _merge_module_facts(reports: list[RankReport]) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """The logical model's state_dict keys (rank 0's order, then keys only later ranks hold), its
    tied-weight aliases and where each extra tensor was written."""
    keys: dict[str, None] = {}
    aliases: dict[str, str] = {}
    extra: dict[str, Any] = {}
    for report in reports:
        assert report.common is not None
        keys.update(dict.fromkeys(report.common["state_dict_keys"]))
        aliases.update(report.common["aliases"])
        extra.update(report.common["extra"])
    return list(keys), aliases, extra


def _logical_shape(facts: dict[str, Any]) -> list[int]:
    placement, shape = facts["placement"], list(facts["shape"])
    if placement["slice_dim"] is not None:
        dim = placement["slice_dim"]
        shape[dim] = placement.get("logical_size") or shape[dim] * placement["num_parts"]
    return shape


def build_manifest(zero: ZeroState, global_steps: int, tag: str, reports: list[RankReport]) -> Manifest:
    """Rank 0: one manifest from every rank's report, checking each parameter is covered once."""
    params = merge_params(reports)
    keys, aliases, extra = _merge_module_facts(reports)
    for report in reports:
        for name, kind, dtype, start, length, file, offset in report.pieces:
            entry = params[name]["kinds"].setdefault(kind, {"dtype": dtype, "slices": []})
            entry["slices"].append([start, length, file, offset])
    for name, record in params.items():
        numel = 1
        for d in record["shape"]:
            numel *= d
        for kind, entry in record["kinds"].items():
            entry["slices"].sort()
            cursor = 0
            for start, length, file, _ in entry["slices"]:
                if start != cursor:
                    raise CheckpointError(f"internal: {kind} of {name} is not tiled by the ranks' shards at element "
                                          f"{cursor} ({file} starts at {start})")
                cursor = start + length
            if cursor != numel:
                raise CheckpointError(f"internal: {kind} of {name} covers {cursor} of {numel} elements")
    files = {name: info for report in reports for name, info in report.files.items()}
    return Manifest(
        tag=tag, global_steps=global_steps, world_size=comm.get_world_size(), stage=zero.sharding.stage,
        precision=zero.precision.name, param_dtype=str(zero.precision.param_dtype).removeprefix("torch."),
        committed_at=time.time(), versions={"zerodist": zerodist.__version__, "torch": torch.__version__},
        files={k: {kk: vv for kk, vv in v.items() if kk != "state"} for k, v in files.items()},
        state_files={v["rank"]: k for k, v in files.items() if v.get("state")},
        params=params, extra=extra, aliases=aliases, state_dict_keys=keys,
        degrees=dict(zero.topology.degrees),
    )


def check_visible(tag_dir: Path, manifest: Manifest) -> None:
    """Rank 0 must see every rank's files: save_dir has to be storage shared by all ranks."""
    for name, info in manifest.files.items():
        path = tag_dir / name
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"rank 0 cannot see rank {info['rank']}'s {path} as written: save_dir must be a "
                                  "directory every rank shares (a network or parallel filesystem)")


def commit(zero: ZeroState, settings: CheckpointConfig, global_steps: int, save_dir: Path, tag: str, reports: list[RankReport],
           save_latest: bool) -> None:
    """Rank 0: manifest (the commit point), then `latest`, then tidy up. Raises on failure."""
    tag_dir = save_dir / tag
    manifest = build_manifest(zero, global_steps, tag, reports)
    check_visible(tag_dir, manifest)
    write_manifest(tag_dir, manifest)
    kill_point("manifest-committed")
    if save_latest:
        try:
            write_latest(save_dir, tag)
        except OSError as err:
            # The checkpoint is complete and committed: keep it. Loading picks the newest committed
            # tag, whatever `latest` says, so a stale `latest` loses nothing; rolling the commit
            # back (as before) threw a complete checkpoint away.
            logger.warning("checkpoint %s is committed, but %s could not be updated (%s); loads still pick %s, the "
                           "newest committed tag", tag, save_dir / "latest", err, tag)
    kill_point("cleanup-started")
    try:
        remove_unreferenced(tag_dir, manifest)
        prune(save_dir, settings.keep_last, keep=tag)
    except OSError as err:  # the checkpoint is committed; tidying is best effort
        logger.warning("checkpoint %s committed, but removing old files failed: %s", tag, err)


class IntervalSaves:
    """The saves every `save_interval` steps. A failed one (no space, no permission: a
    `CheckpointWriteError`, the same on every rank) warns on every rank and training goes on,
    to try again at the next interval, until `max_failed_saves` have failed in a row; the
    earlier checkpoints stay intact. `last_error` is the failure of the latest interval save,
    None once one succeeds: a run that ends with it set has not saved its last steps."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.failed_in_a_row = 0
        self.last_error: CheckpointWriteError | None = None

    def after_step(self, global_steps: int, save: Any) -> None:
        interval = self.settings.save_interval
        if not interval or global_steps % interval:
            return
        try:
            save()
        except CheckpointWriteError as err:
            self.failed_in_a_row += 1
            self.last_error = err
            limit = self.settings.max_failed_saves
            if self.failed_in_a_row >= limit:
                raise CheckpointWriteError(f"{self.failed_in_a_row} interval saves in a row failed "
                                           f"(checkpoint.max_failed_saves is {limit}); the last: {err}") from err
            logger.warning("step %d: %s. Training goes on; the next save is at step %d (%d of %d interval saves "
                           "failed in a row; checkpoint.max_failed_saves stops training at %d)", global_steps, err,
                           global_steps + interval, self.failed_in_a_row, limit, limit)
            return
        self.failed_in_a_row, self.last_error = 0, None


def remove_unreferenced(tag_dir: Path, manifest: Manifest) -> None:
    """Files in the tag directory left by earlier, interrupted saves of the same tag."""
    keep = set(manifest.files) | {MANIFEST}
    for path in sorted(tag_dir.iterdir()):
        if path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)
            kill_point("cleanup-partial")


def prune(save_dir: Path, keep_last: int, keep: str) -> None:
    """Delete the oldest committed checkpoints beyond `keep_last` (0 keeps all). Each loses its
    manifest first, so a crash midway leaves an uncommitted tag, never a half-deleted committed one."""
    if keep_last <= 0:
        return
    listing = list_checkpoints(save_dir)
    protected = {keep, listing.latest}
    surplus = len(listing.committed) - keep_last
    for manifest in listing.committed:
        if surplus <= 0:
            break
        if manifest.tag in protected:
            continue
        tag_dir = save_dir / manifest.tag
        (tag_dir / MANIFEST).unlink(missing_ok=True)
        kill_point("cleanup-partial")
        shutil.rmtree(tag_dir, ignore_errors=True)
        surplus -= 1
        log_rank0(logger, "removed checkpoint %s (keep_last=%d)", manifest.tag, keep_last)


def _discard(tag_dir: Path, rank: int, save_id: str) -> None:
    """After a failed save (collective): every rank's files of this save, never a committed
    checkpoint's; then the tag directory if that leaves it empty."""
    for pattern in (f"*-r{rank:05d}-{save_id}.*", f".*-r{rank:05d}-{save_id}.*"):
        for path in tag_dir.glob(pattern):
            path.unlink(missing_ok=True)
    comm.barrier()
    if rank == 0:
        try:
            tag_dir.rmdir()  # only when empty: a directory this save created and nothing else uses
        except OSError:
            pass
    comm.barrier()  # so every rank returns to a tidy directory


def save_checkpoint(zero: ZeroState, resumable: Resumable, save_dir: str | Path, *, settings: CheckpointConfig, tag: Any = None,
                    client_state: Any = None, save_latest: bool = True) -> str:
    """Save the ZeRO state and the training state under `save_dir/tag` (collective: call on every
    rank). `settings` is the config's `checkpoint` section.

    Returns the checkpoint directory. Raises `CheckpointAgreementError` when not every rank
    calls it, `CheckpointWriteError` (on every rank) when a rank cannot write."""
    kill_point("save-start")
    training = resumable.training_state_dict()
    steps = training["global_steps"]
    save_dir = Path(save_dir).absolute()
    tag = check_tag_name(f"global_step{steps}" if tag is None else tag)
    tag, save_id = agree_on_tag(settings, tag, save_dir, steps)
    kill_point("tag-agreed")
    rank, tag_dir = comm.get_rank(), save_dir / tag
    if training["micro_steps"] % training["gradient_accumulation_steps"]:
        log_rank0(logger, "save_checkpoint(%r) in the middle of a gradient accumulation (micro-step %d): the "
                  "gradients accumulated since step %d are not saved; save after engine.step() at a boundary",
                  tag, training["micro_steps"], steps, level=30)
    started = time.perf_counter()
    facts = gather_facts(zero)
    report, failure = None, None
    try:
        report = write_rank_files(zero, training, facts, tag_dir, save_id, rank, client_state)
    except Exception as err:  # reported to rank 0 so every rank fails together, not one of them hanging
        failure = err
        report = RankReport(rank, {}, [], error=f"rank {rank}: {type(err).__name__}: {err}")
    kill_point("before-gather")
    reports: list[Any] = [None] * comm.get_world_size() if rank == 0 else []
    comm.gather_object(report, reports if rank == 0 else None, dst=0)
    kill_point("after-gather")
    outcome: list[str | None] = [None]
    if rank == 0:
        errors = [r.error for r in reports if r.error]
        if not errors:
            try:
                commit(zero, settings, steps, save_dir, tag, reports, save_latest)
            except Exception as err:
                failure = failure or err
                errors.append(f"rank 0 committing: {type(err).__name__}: {err}")
        outcome[0] = "; ".join(errors) or None
    kill_point("before-outcome")
    comm.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        _discard(tag_dir, rank, save_id)
        raise CheckpointWriteError(f"save_checkpoint({tag!r}) failed and committed nothing (earlier checkpoints in "
                                   f"{save_dir} are untouched): {outcome[0]}") from failure
    kill_point("save-done")
    log_rank0(logger, "saved checkpoint %s (step %d) in %.2f s", tag_dir, steps,
              time.perf_counter() - started)
    return str(tag_dir)
