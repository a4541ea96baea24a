"""DeepSpeed checkpoints in: what DeepSpeed 0.19 writes at ZeRO stages 0-3, as a zerodist checkpoint.

    import_deepspeed("ds_ckpt", "zd_ckpt")          # `zerodist checkpoint import-deepspeed DIR OUT`
    engine.load_checkpoint("ds_ckpt")               # detected by its files, converted on the fly

DeepSpeed's layout, by stage (`tag_dir` is `DIR/global_stepN`, or `DIR/<latest>`):

    stage 0   mp_rank_00_model_states.pt            module, optimizer (torch's state dict; under
                                                    fp16/bf16 also fp32_groups[_flat], the masters)
    stage 1-2 mp_rank_00_model_states.pt            module, param_shapes, shared_params, steps, ...
              [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   per rank R: the flat fp32 partition
                                                    of each param group, its Adam state, paddings
    stage 3   zero_pp_rank_R_mp_rank_00_model_states.pt           per rank: the same facts, and
              [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt    each parameter's own partition

[Note: DeepSpeed flat partitions] Stages 1-2 concatenate a param group's parameters (in
`param_shapes` order, each followed by `param_alignment_paddings`) into one flat tensor padded at
its end, and rank R holds the R-th equal part: concatenating the ranks' parts gives the group back.
Stage 3 partitions every parameter on its own into `ceil(numel / ranks)` elements per rank (the
last padded); rank R's flat sub-group is its part of each parameter in turn. Adam's `exp_avg` and
`exp_avg_sq` have the fp32 partition's layout. `zero_to_fp32.py` reads the weights the same way.

The files are unpickled with `weights_only=True`; the three DeepSpeed classes they hold
(`LossScaler`/`DynamicLossScaler`, `ZeroStageEnum`, `fragment_address`) are read into stand-ins, so
DeepSpeed need not be installed. The result is a full, unsharded state (`ImportedState`), which
`write_zerodist_checkpoint` writes as a one-rank checkpoint: any world size and stage loads it
(`zerodist.checkpoint.load` converts a DeepSpeed directory it is given, then loads it as its own).
DeepSpeed saves no random-number state, so a resumed run's streams start afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import math
import pickle
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zerodist
import zerodist.comm as comm
from zerodist.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from zerodist.checkpoint.files import AtomicFile, tensor_bytes, write_atomic
from zerodist.checkpoint.manifest import (OPTIMIZER_PREFIX, PARAM, Manifest, check_tag_name, write_latest,
                                          write_manifest)
from zerodist.utils import get_logger

logger = get_logger(__name__)

MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
# Top-level keys DeepSpeed itself writes into the model-states file; every other key is the
# `client_state` the user passed to save_checkpoint (DeepSpeed returns them the same way).
DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "autoep_layers", "moe_layers",
}


class DeepSpeedImportError(CheckpointError):
    """A DeepSpeed checkpoint directory is incomplete, damaged, or holds what zerodist cannot import."""


# ------------------------------------------------------------------ unpickling without DeepSpeed

class _Record:
    """Stand-in for a DeepSpeed object in a pickle (LossScaler, fragment_address): its attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class _LossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


def _zero_stage(value: Any) -> int:
    """`ZeroStageEnum(value)` is pickled as a call; its value is the stage number."""
    return int(value)


_STAND_INS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path, trust_pickle: bool = False) -> dict[str, Any]:
    """One DeepSpeed file, unpickled with weights_only=True and stand-ins for DeepSpeed's classes
    (or fully, running what the pickle asks, with `trust_pickle`)."""
    if not path.is_file():
        raise DeepSpeedImportError(f"DeepSpeed checkpoint {path.parent} is incomplete: {path.name} is missing")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            data = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as err:
        needed = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = needed.group(1) if needed else "an object"
        raise DeepSpeedImportError(
            f"{path}: holds {what}, which is not one of the DeepSpeed classes zerodist reads safely (weights_only "
            "unpickling); it may come from your client_state. If you trust the file, convert it with `zerodist "
            "checkpoint import-deepspeed --trust-pickle` (import_deepspeed(..., trust_pickle=True)), which runs what "
            f"the pickle asks and needs {what}'s module importable") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointCorruptError(f"DeepSpeed checkpoint file {path} cannot be read (truncated or damaged?): "
                                     f"{err}") from None
    if not isinstance(data, dict):
        raise DeepSpeedImportError(f"{path}: not a DeepSpeed checkpoint file (holds a {type(data).__name__})")
    return data


# ------------------------------------------------------------------ finding a DeepSpeed checkpoint

def deepspeed_tag_dir(path: str | Path, tag: Any = None) -> Path | None:
    """The DeepSpeed tag directory `path` names (itself, `path/tag`, or `path/<latest>`), or None
    when `path` is not a DeepSpeed checkpoint (has no DeepSpeed model-states file)."""
    path = Path(path)
    candidates = [path / str(tag)] if tag is not None else [path]
    if tag is None and (path / "latest").is_file():
        candidates.append(path / (path / "latest").read_text(encoding="utf-8").strip())
    for candidate in candidates:
        if (candidate / MODEL_STATES).is_file() or (candidate / ZERO3_MODEL_STATES.format(rank=0)).is_file():
            return candidate
    return None


# ------------------------------------------------------------------ the full state

@dataclasses.dataclass
class ImportedState:
    """A checkpoint's whole training state, unsharded, keyed by the plain model's names."""

    params: dict[str, torch.Tensor]  # trained parameters: fp32 master values
    optimizer: dict[str, dict[str, torch.Tensor]]  # name -> elementwise state (exp_avg, exp_avg_sq)
    scalars: dict[str, dict[str, Any]]  # name -> non-elementwise state of its param group (Adam's step)
    group_of: dict[str, int]  # name -> index of its optimizer param group
    options: list[dict[str, Any]]  # per param group: lr, betas, eps, weight_decay, ...
    optimizer_class: str
    extra: dict[str, torch.Tensor]  # buffers and frozen parameters
    state_dict_keys: list[str]
    aliases: dict[str, str]  # tied weights: state_dict key -> the trained parameter's name
    global_steps: int
    micro_steps: int
    skipped_steps: int
    loss_scaler: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    client_state: dict[str, Any]
    precision: str
    source: str  # "DeepSpeed 0.19.8, ZeRO stage 2, 2 ranks"


@dataclasses.dataclass
class _Optimizer:
    """What a reader found of the optimizer, by parameter name (fields as in ImportedState)."""

    stage: int
    params: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    optimizer: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    group_of: dict[str, int] = dataclasses.field(default_factory=dict)
    param_groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    loss_scaler: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, names: list[str], state: dict[str, Any], group: int) -> None:
        """The non-elementwise state and param group of `names`, stepped together."""
        for name in names:
            self.scalars[name], self.group_of[name] = _scalars(state, self.param_groups[group]), group


def _ranks_files(tag_dir: Path, num_ranks: int) -> list[Path]:
    """The optimizer-state file of every rank, checking none is missing (by DeepSpeed's own count)."""
    found = {int(m.group(2)): tag_dir / m.group(0) for p in tag_dir.iterdir() if (m := OPTIM_STATES.match(p.name))}
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in found.values()) else ""
    missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(num_ranks) if r not in found]
    if missing:
        raise DeepSpeedImportError(f"DeepSpeed checkpoint {tag_dir} is incomplete: it was saved by {num_ranks} ranks "
                                   f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    return [found[r] for r in range(num_ranks)]


def _trained_names(param_shapes: list[dict[str, Any]]) -> list[tuple[str, torch.Size]]:
    return [(name, torch.Size(shape)) for group in param_shapes for name, shape in group.items()]


def _split_flat(flat: torch.Tensor, shapes: list[tuple[str, torch.Size]], paddings: list[int] | None,
                where: str) -> dict[str, torch.Tensor]:
    """Stages 1-2: one param group's whole flat tensor back into parameters ([Note: DeepSpeed flat partitions])."""
    out, offset = {}, 0
    for index, (name, shape) in enumerate(shapes):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise DeepSpeedImportError(f"{where}: the flat partitions hold {flat.numel()} elements, too few for "
                                       f"{name} {tuple(shape)} at element {offset}")
        out[name] = flat[offset: offset + numel].view(shape).clone()
        offset += numel + (paddings[index] if paddings else 0)
    return out


def _zero3_split(flats: list[torch.Tensor], *, shapes: list[tuple[str, torch.Size]], where: str
                 ) -> dict[str, torch.Tensor]:
    """Stage 3: every rank's flat part of each parameter in turn ([Note: DeepSpeed flat partitions])."""
    ranks, out, offset = len(flats), {}, 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / ranks)
        if offset + part > flats[0].numel():
            raise DeepSpeedImportError(f"{where}: the per-rank partitions hold {flats[0].numel()} elements, too few "
                                       f"for {name} {tuple(shape)}")
        out[name] = torch.cat([f[offset: offset + part] for f in flats])[:numel].view(shape).clone()
        offset += part
    if offset != flats[0].numel():
        raise DeepSpeedImportError(f"{where}: the parameters use {offset} of the {flats[0].numel()} elements of each "
                                   "rank's partition: the model states and the optimizer states disagree")
    return out


def _read_zero(tag_dir: Path, model_states: dict[str, Any], zero3: bool, num_ranks: int) -> _Optimizer:
    """Stages 1-3: every rank's optimizer file, reassembled by parameter."""
    stage = 3 if zero3 else 2  # until the files say 1 or 2 (the layout is the same)
    files = _ranks_files(tag_dir, num_ranks)
    shards = [_load(f)["optimizer_state_dict"] for f in files]
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    for f, shard in zip(files, shards):
        if base_key not in shard or flat_key not in shard:
            raise DeepSpeedImportError(f"{f}: no {flat_key!r}/{base_key!r}; not a ZeRO stage {stage} optimizer file")
    shapes = _trained_names(model_states["param_shapes"])
    base = [s[base_key] for s in shards]
    num_flat = len(shards[0][flat_key])
    # Per flat group (stages 1-2: a param group; stage 3: a sub-group): its names, and a function
    # that turns the ranks' parts of one per-element tensor into per-parameter tensors.
    if stage == 3:
        sizes = [t.numel() for t in shards[0][flat_key]]
        members, start = [], 0
        for size in sizes:
            used, names = 0, []
            while used < size and start < len(shapes):
                names.append(shapes[start])
                used += math.ceil(math.prod(shapes[start][1]) / num_ranks)
                start += 1
            members.append(names)
        split = [functools.partial(_zero3_split, shapes=names, where=str(tag_dir)) for names in members]
    else:
        groups = model_states["param_shapes"]
        paddings = shards[0].get("param_alignment_paddings") or [None] * num_flat
        members = [_trained_names([g]) for g in groups]
        split = [functools.partial(_split_parts, shapes=names, paddings=pad, where=str(tag_dir))
                 for names, pad in zip(members, paddings)]
    if len(members) != num_flat:
        raise DeepSpeedImportError(f"{tag_dir}: {len(members)} parameter groups in the model states, {num_flat} in "
                                   "the optimizer states")
    found = _Optimizer(stage if zero3 else int(shards[0].get("zero_stage", stage)), param_groups=base[0]["param_groups"],
                       loss_scaler=dict(vars(shards[0].get("loss_scaler", _LossScaler()))))
    owner = {index: j for j, pg in enumerate(found.param_groups) for index in pg["params"]}
    for k in range(num_flat):
        found.params.update(split[k]([s[flat_key][k].float() for s in shards]))
        state = base[0]["state"].get(k, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for name, tensor in split[k]([b["state"][k][key].float() for b in base]).items():
                    found.optimizer.setdefault(name, {})[key] = tensor
        found.add([name for name, _ in members[k]], state, owner.get(k, 0))
    return found


def _split_parts(parts: list[torch.Tensor], shapes: list[tuple[str, torch.Size]], paddings: list[int] | None,
                 where: str) -> dict[str, torch.Tensor]:
    return _split_flat(torch.cat(parts), shapes, paddings, where)


def _scalars(state: dict[str, Any], param_group: dict[str, Any]) -> dict[str, Any]:
    """Non-elementwise optimizer state; FusedAdam keeps `step` as an int (or in the param group)."""
    out = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    if "step" not in out and "step" in param_group:
        out["step"] = param_group["step"]
    if "step" in out and not isinstance(out["step"], torch.Tensor):
        out["step"] = torch.tensor(float(out["step"]))  # torch's Adam keeps a float32 tensor
    return out


def _deal(candidates: list[str], shapes: dict[str, tuple[int, ...]], slots: list[list[tuple[int, ...] | None]],
          where: Path) -> list[list[str]]:
    """Stage 0 names none of the optimizer's parameters. Find the one way to deal the model's
    parameters (in module order) out to the param groups' slots, each group keeping module order
    (as groups built by filtering `named_parameters()` do) and every shape agreeing (None: any);
    parameters dealt to no group are frozen. Raises when there is no way, or more than one."""
    # Forward over the candidates: group positions reached -> (number of ways (capped at 2), parent, group).
    history: list[dict[tuple[int, ...], tuple[int, Any, int]]] = []
    frontier: dict[tuple[int, ...], tuple[int, Any, int]] = {tuple(0 for _ in slots): (1, None, -1)}
    for name in candidates:
        reached: dict[tuple[int, ...], tuple[int, Any, int]] = {}
        for position, (ways, _, _) in frontier.items():
            for j in [j for j, group in enumerate(slots)
                      if position[j] < len(group) and group[position[j]] in (None, shapes[name])] + [-1]:
                after = position if j < 0 else position[:j] + (position[j] + 1,) + position[j + 1:]
                before = reached.get(after, (0, position, j))
                reached[after] = (min(2, before[0] + ways), before[1], before[2])
        history.append(frontier := reached)
        if len(frontier) > 100_000:
            break
    final = tuple(len(group) for group in slots)
    ways = frontier.get(final, (0, None, -1))[0] if len(frontier) <= 100_000 else 2
    if ways != 1:
        raise DeepSpeedImportError(
            f"{where}: a ZeRO stage 0 checkpoint does not name the optimizer's parameters, and the model's "
            f"{len(candidates)} parameters fit its {len(slots)} param group(s) of {[len(g) for g in slots]} in "
            f"{'no' if ways == 0 else 'more than one'} way (by order and shape); save it again with ZeRO stage 1")
    dealt: list[list[str]] = [[] for _ in slots]
    position = final
    for name, step in zip(reversed(candidates), reversed(history)):
        _, parent, j = step[position]
        if j >= 0:
            dealt[j].insert(0, name)
        position = parent
    return dealt


def _read_stage0(model_states: dict[str, Any], candidates: list[str], where: Path) -> _Optimizer:
    """Stage 0: torch's optimizer state dict (fp32: the module holds the masters), or DeepSpeed's
    fp16/bf16 wrapper around it with the masters as `fp32_groups` (one tensor per parameter) or
    `fp32_groups_flat` (one flat tensor per param group, unpadded)."""
    saved = model_states.get("optimizer")
    if not isinstance(saved, dict):
        raise DeepSpeedImportError(f"{where}: no optimizer state (saved without it?); load it with "
                                   "load_module_only=True or load_optimizer_states=False instead")
    wrapped = "optimizer_state_dict" in saved
    inner = saved["optimizer_state_dict"] if wrapped else saved
    param_groups, module = inner["param_groups"], model_states["module"]
    # Units the optimizer steps, each (parameter names, master values, optimizer index, param group).
    units: list[tuple[list[str], torch.Tensor, int, int]] = []
    if wrapped and "fp32_groups_flat" in saved:
        if len(param_groups) != 1 or saved["fp32_groups_flat"][0].numel() != sum(module[n].numel() for n in candidates):
            raise DeepSpeedImportError(f"{where}: fp16 ZeRO stage 0 with DeepSpeed's fused optimizer keeps one flat "
                                       "master per param group, which zerodist can attribute only for one group "
                                       "holding every parameter; save it again with ZeRO stage 1")
        units.append((candidates, saved["fp32_groups_flat"][0], param_groups[0]["params"][0], 0))
    else:
        masters: Any = saved["fp32_groups"] if wrapped else None  # DeepSpeed's per-group lists
        slots = [[tuple(masters[j][p].shape) if wrapped else
                  tuple(inner["state"][i]["exp_avg"].shape) if "exp_avg" in inner["state"].get(i, {}) else None
                  for p, i in enumerate(pg["params"])] for j, pg in enumerate(param_groups)]
        dealt = _deal(candidates, {n: tuple(module[n].shape) for n in candidates}, slots, where)
        units = [([name], masters[j][p] if wrapped else module[name], pg["params"][p], j)
                 for j, (names, pg) in enumerate(zip(dealt, param_groups)) for p, name in enumerate(names)]
    found = _Optimizer(0, param_groups=param_groups, loss_scaler={
        k: saved[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "dynamic_loss_scale") if k in saved})
    for names, master, index, j in units:
        shapes = [(n, module[n].shape) for n in names]
        if master.numel() != sum(math.prod(s) for _, s in shapes):
            raise DeepSpeedImportError(f"{where}: optimizer parameter {index} has {master.numel()} elements, the "
                                       f"parameters {names} {sum(math.prod(s) for _, s in shapes)}")
        found.params.update(_split_flat(master.detach().float().reshape(-1), shapes, None, str(where)))
        state = inner["state"].get(index, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for name, tensor in _split_flat(value.float().reshape(-1), shapes, None, str(where)).items():
                    found.optimizer.setdefault(name, {})[key] = tensor
        found.add(names, state, j)
    return found


def _aliases(module: dict[str, torch.Tensor], buffers: set[str]) -> dict[str, str]:
    """Stage 0 records no tied weights: torch.save kept their shared storage, which tells them."""
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases = {}
    for key, value in module.items():
        if key in buffers or value.numel() == 0:
            continue
        ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()), tuple(value.shape))
        if ident in first:
            aliases[key] = first[ident]
        else:
            first[ident] = key
    return aliases


def _frozen(tag_dir: Path, model_states: dict[str, Any], stage: int, num_ranks: int, trust_pickle: bool
            ) -> dict[str, torch.Tensor]:
    """Frozen parameters: whole at stages 1-2, partitioned like the trained ones at stage 3."""
    shapes = model_states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if stage < 3:
        return {name: model_states["frozen_param_fragments"][name].clone() for name in shapes}
    ranks = [model_states] + [_load(tag_dir / ZERO3_MODEL_STATES.format(rank=r), trust_pickle)
                              for r in range(1, num_ranks)]
    return {name: torch.cat([r["frozen_param_fragments"][name].reshape(-1) for r in ranks])[:math.prod(shape)]
            .view(shape).clone() for name, shape in shapes.items()}


def _optimizer_class(param_groups: list[dict[str, Any]], ds_config: dict[str, Any], where: Path) -> str:
    """The torch.optim class that steps as DeepSpeed's optimizer did (zerodist checks it on load)."""
    group = param_groups[0]
    if group.get("bias_correction") is False:
        raise DeepSpeedImportError(f"{where}: Adam without bias correction (bias_correction=false) has no torch.optim "
                                   "equivalent; zerodist cannot continue this optimizer")
    if "decoupled_weight_decay" in group:  # torch.optim.Adam / AdamW (DeepSpeed's torch_adam)
        return "AdamW" if group["decoupled_weight_decay"] else "Adam"
    if "nesterov" in group and "momentum" in group:
        return "SGD"
    settings = ds_config.get("optimizer") or {}
    kind, options = str(settings.get("type", "")).lower(), settings.get("params") or {}
    if kind == "adamw" or (kind == "adam" and options.get("adam_w_mode", True)):
        return "AdamW"  # FusedAdam / DeepSpeedCPUAdam in adam_w_mode
    if kind == "adam":
        return "Adam"
    raise DeepSpeedImportError(f"{where}: cannot tell which optimizer wrote this state (DeepSpeed config optimizer "
                               f"{settings.get('type')!r}); zerodist imports Adam, AdamW and SGD state")


def _loss_scaler(raw: dict[str, Any], precision: str) -> dict[str, Any]:
    """DeepSpeed's (Dynamic)LossScaler as zerodist's LossScaler state (fp16 only; else unchanged).
    DeepSpeed doubles the scale when (cur_iter - last_overflow_iter) % window == 0 before
    counting the step; zerodist counts first, so steps_since_overflow = cur_iter - 1 - last."""
    if precision != "fp16" or "cur_scale" not in raw:
        return {}
    state: dict[str, Any] = {"scale": float(raw["cur_scale"])}
    if "cur_iter" in raw and "last_overflow_iter" in raw:
        state["steps_since_overflow"] = max(0, int(raw["cur_iter"]) - 1 - int(raw["last_overflow_iter"]))
    if "cur_hysteresis" in raw:
        state["hysteresis_left"] = int(raw["cur_hysteresis"])
    return state


def _scheduler(saved: Any, ds_config: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """DeepSpeed's schedules save only `last_batch_iteration`; zerodist's (same formulas, same
    iteration numbering after a load) also want the base learning rates: the config's lr."""
    if not isinstance(saved, dict):
        return None
    if "base_lrs" in saved or "last_batch_iteration" not in saved:
        return dict(saved)  # a torch.optim.lr_scheduler's own state
    lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr")
    return {"last_batch_iteration": saved["last_batch_iteration"],
            "base_lrs": [pg.get("initial_lr", lr if isinstance(lr, (int, float)) else pg["lr"]) for pg in param_groups]}


def read_deepspeed_checkpoint(path: str | Path, tag: Any = None, trust_pickle: bool = False) -> ImportedState:
    """The full training state in a DeepSpeed checkpoint (`path` is the save directory, with
    `latest` or a `tag`, or one tag's directory). Raises DeepSpeedImportError naming any missing
    file. `trust_pickle` unpickles the model-states files fully (for a client_state of other classes)."""
    tag_dir = deepspeed_tag_dir(path, tag)
    if tag_dir is None:
        where = Path(path) / str(tag) if tag is not None else Path(path)
        raise CheckpointNotFoundError(f"{where}: not a DeepSpeed checkpoint (no {MODEL_STATES} or "
                                      f"{ZERO3_MODEL_STATES.format(rank=0)} in it, nor a 'latest' naming such a tag)")
    zero3 = not (tag_dir / MODEL_STATES).is_file()
    model_states = _load(tag_dir / (ZERO3_MODEL_STATES.format(rank=0) if zero3 else MODEL_STATES), trust_pickle)
    if "module" not in model_states:
        raise DeepSpeedImportError(f"{tag_dir}: the model-states file holds no 'module'")
    if model_states.get("mp_world_size", 1) != 1:
        raise DeepSpeedImportError(f"{tag_dir}: saved with model parallelism (mp_world_size "
                                   f"{model_states['mp_world_size']}); zerodist imports data-parallel ZeRO checkpoints")
    num_ranks = int(model_states.get("dp_world_size", 1))
    if zero3:
        missing = [ZERO3_MODEL_STATES.format(rank=r) for r in range(num_ranks)
                   if not (tag_dir / ZERO3_MODEL_STATES.format(rank=r)).is_file()]
        if missing:
            raise DeepSpeedImportError(f"DeepSpeed checkpoint {tag_dir} is incomplete: it was saved by {num_ranks} "
                                       f"ranks but {', '.join(missing)} missing")
    ds_config = model_states.get("ds_config") or {}
    module = model_states["module"]
    buffer_names = list(model_states.get("buffer_names") or [])
    extra = {k: module[k].clone() for k in buffer_names if k in module}
    if model_states.get("param_shapes") is not None:  # stages 1-3
        aliases = dict(model_states.get("shared_params") or {})
        found = _read_zero(tag_dir, model_states, zero3, num_ranks)
        extra.update(_frozen(tag_dir, model_states, found.stage, num_ranks, trust_pickle))
    else:
        aliases = _aliases(module, set(buffer_names))
        candidates = [k for k in module if k not in buffer_names and k not in aliases]
        found = _read_stage0(model_states, candidates, tag_dir / MODEL_STATES)
        extra.update({k: module[k].clone() for k in candidates if k not in found.params})  # frozen
    dtypes = {module[n].dtype for n in found.params if n in module}
    precision = "fp16" if torch.float16 in dtypes else "bf16" if torch.bfloat16 in dtypes else "fp32"
    gas = ds_config.get("gradient_accumulation_steps", 1)
    steps = int(model_states.get("global_steps", 0))
    groups = found.param_groups
    return ImportedState(
        params=found.params, optimizer=found.optimizer, scalars=found.scalars, group_of=found.group_of,
        options=[{k: v for k, v in pg.items() if k != "params"} for pg in groups],
        optimizer_class=_optimizer_class(groups, ds_config, tag_dir), extra=extra, state_dict_keys=list(module),
        aliases=aliases, global_steps=steps, micro_steps=steps * (gas if isinstance(gas, int) else 1),
        skipped_steps=int(model_states.get("skipped_steps", 0)), loss_scaler=_loss_scaler(found.loss_scaler, precision),
        lr_scheduler=_scheduler(model_states.get("lr_scheduler"), ds_config, groups),
        client_state={k: v for k, v in model_states.items() if k not in DEEPSPEED_KEYS}, precision=precision,
        source=f"DeepSpeed {model_states.get('ds_version', '?')}, ZeRO stage {found.stage}, {num_ranks} rank(s)",
    )


# ------------------------------------------------------------------ zerodist's format

def write_zerodist_checkpoint(state: ImportedState, save_dir: str | Path, tag: str, save_latest: bool = True) -> Path:
    """`state` as a one-rank zerodist checkpoint under `save_dir/tag` (the only code here that
    knows the manifest; see [Note: layout-free manifest]). File names carry a digest of the
    contents, so ranks that convert the same checkpoint write the same bytes."""
    tag_dir = Path(save_dir) / check_tag_name(tag)
    tag_dir.mkdir(parents=True, exist_ok=True)
    chunks = [(name, PARAM, value) for name, value in state.params.items()]
    chunks += [(name, OPTIMIZER_PREFIX + key, value) for name in state.params
               for key, value in state.optimizer.get(name, {}).items()]
    extra = list(state.extra.items())
    digest = hashlib.sha1(state.source.encode())
    for _, _, tensor in chunks + [(k, "", t) for k, t in extra]:
        digest.update(tensor_bytes(tensor))
    save_id = "ds" + digest.hexdigest()[:10]
    shard, state_file = f"shard-r00000-{save_id}.bin", f"state-r00000-{save_id}.pt"
    params: dict[str, dict[str, Any]] = {n: {"shape": list(v.shape), "kinds": {}} for n, v in state.params.items()}
    extra_info = {}
    with AtomicFile(tag_dir / shard) as out:
        for name, kind, tensor in chunks:
            offset = out.write(tensor_bytes(tensor))
            params[name]["kinds"][kind] = {"dtype": "float32", "slices": [[0, tensor.numel(), shard, offset]]}
        for key, tensor in extra:
            extra_info[key] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                               "file": shard, "offset": out.write(tensor_bytes(tensor))}
        out.commit()
    files = {shard: {"rank": 0, "bytes": out.nbytes, "crc32": out.checksum}}
    buffer = io.BytesIO()
    torch.save({"rank": 0, "rng": None, "data": None, "common": {
        "global_steps": state.global_steps, "micro_steps": state.micro_steps, "skipped_steps": state.skipped_steps,
        "loss_scaler": state.loss_scaler, "lr_scheduler": state.lr_scheduler, "client_state": state.client_state,
        "optimizer": {"class": state.optimizer_class, "options": state.options, "group_of": state.group_of,
                      "scalars": state.scalars}}}, buffer)
    nbytes, checksum = write_atomic(tag_dir / state_file, buffer.getvalue())
    files[state_file] = {"rank": 0, "bytes": nbytes, "crc32": checksum}
    param_dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(state.precision, "float32")
    manifest = Manifest(
        tag=tag_dir.name, global_steps=state.global_steps, world_size=1, stage=0, precision=state.precision,
        param_dtype=param_dtype, committed_at=time.time(),
        versions={"zerodist": zerodist.__version__, "torch": torch.__version__, "imported_from": state.source},
        files=files, state_files={0: state_file}, params=params, extra=extra_info, aliases=state.aliases,
        state_dict_keys=state.state_dict_keys)
    write_manifest(tag_dir, manifest)
    if save_latest:
        write_latest(Path(save_dir), tag_dir.name)
    return tag_dir


def import_deepspeed(path: str | Path, out: str | Path, tag: Any = None, trust_pickle: bool = False
                     ) -> tuple[Path, ImportedState]:
    """Convert a DeepSpeed checkpoint to a zerodist one under `out` (same tag name); returns the
    new tag directory and what was read. No process group needed."""
    try:
        state = read_deepspeed_checkpoint(path, tag, trust_pickle)
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise DeepSpeedImportError(f"{path}: not laid out as DeepSpeed 0.19 writes ZeRO 0-3 checkpoints "
                                   f"({type(err).__name__}: {err})") from err
    tag_dir = deepspeed_tag_dir(path, tag)
    assert tag_dir is not None  # read_deepspeed_checkpoint found it
    return write_zerodist_checkpoint(state, out, tag_dir.resolve().name), state


def agreed_tag_dir(load_dir: str | Path, tag: Any) -> Path | None:
    """Collective: the DeepSpeed tag directory `load_dir` (and `tag`) names, as rank 0 sees it;
    None when it is not a DeepSpeed checkpoint. Every rank takes the same path through a load."""
    found: list[Any] = [None]
    if comm.get_rank() == 0:
        found[0] = deepspeed_tag_dir(load_dir, tag)
    comm.broadcast_object_list(found, src=0)
    return found[0]
