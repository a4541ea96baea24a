"""Hand-built DeepSpeed 0.19 checkpoint directories, for tests that run without DeepSpeed.

    truth = write_deepspeed_checkpoint(tmp_path, stage=2, world_size=3)

writes `tmp_path/latest` and `tmp_path/global_step5/...` exactly as DeepSpeed lays them out (the
files, keys, flat partitions with their paddings, and DeepSpeed's own pickled classes under their
DeepSpeed names: LossScaler, ZeroStageEnum, fragment_address), and returns the state they hold.
The layout was read off checkpoints DeepSpeed 0.19.8 wrote (tests/deepspeed_reference.py), see
[Note: DeepSpeed flat partitions] in zerodist/checkpoint/deepspeed_import.py.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEP = 5
LR = 2e-3
CLIENT_STATE = {"epoch": 2, "samples_seen": 80}


class FixtureModel(nn.Module):
    """Tied embedding, LayerNorm, a bias of odd length (partitions pad), a buffer and (optionally)
    a frozen layer; two optimizer param groups that interleave in module order."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            self.emb = nn.Embedding(10, 6)
            self.norm = nn.LayerNorm(6)
            self.proj = nn.Linear(6, 5)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("gain", torch.linspace(0.5, 1.5, 6))
            self.frozen = nn.Linear(6, 6) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(idx)) * self.gain
        if self.frozen is not None:
            x = x + self.frozen(x)
        return self.head(x) + self.proj(x).sum(-1, keepdim=True)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [model.emb.weight, model.proj.weight]
    no_decay = [model.norm.weight, model.norm.bias, model.proj.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def group_names(model: nn.Module) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in param_groups(model)]


@dataclasses.dataclass
class Truth:
    """What the hand-built checkpoint holds, by parameter name."""

    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    module: dict[str, torch.Tensor]  # the model's state_dict as DeepSpeed saved it
    tag_dir: Path


# DeepSpeed's classes, pickled under DeepSpeed's names without DeepSpeed installed.
class LossScaler:
    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)


class ZeroStageEnum:
    def __init__(self, value: int):
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return ZeroStageEnum, (self.value,)


class FragmentAddress:
    def __init__(self, numel: int, start: int):
        self.numel, self.start = numel, start


_NAMES = {LossScaler: "deepspeed.runtime.fp16.loss_scaler.LossScaler",
          ZeroStageEnum: "deepspeed.runtime.zero.config.ZeroStageEnum",
          FragmentAddress: "deepspeed.utils.tensor_fragment.fragment_address"}


class _DeepSpeedPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj not in _NAMES:
            return super().save_global(obj, name)
        module, _, qualname = _NAMES[obj].rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_PICKLE = types.SimpleNamespace(Pickler=_DeepSpeedPickler, __name__="pickle")


def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path, pickle_module=_PICKLE)


def _adam_groups(model: nn.Module, indices: list[list[int]]) -> list[dict[str, Any]]:
    """torch AdamW's param groups as DeepSpeed's torch_adam saves them."""
    return [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": g["weight_decay"], "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "params": idx} for g, idx in zip(param_groups(model), indices)]


def _common(model: nn.Module, stage: int, world_size: int) -> dict[str, Any]:
    return {
        "buffer_names": ["gain"], "lr_scheduler": {"last_batch_iteration": STEP - 1}, "data_sampler": None,
        "random_ltd": None, "skipped_steps": 0, "global_steps": STEP, "global_samples": STEP * 4 * world_size,
        "dp_world_size": world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {
            "lr": LR, "torch_adam": True}}, "zero_optimization": {"stage": stage}},
        "ds_version": "0.19.8", **CLIENT_STATE,
    }


def write_deepspeed_checkpoint(save_dir: Path, stage: int, world_size: int) -> Truth:
    """A DeepSpeed checkpoint at `stage` from `world_size` ranks under `save_dir` (tag global_step5)."""
    model = FixtureModel(frozen=True)
    tag_dir = Path(save_dir) / f"global_step{STEP}"
    tag_dir.mkdir(parents=True)
    (Path(save_dir) / "latest").write_text(tag_dir.name)
    g = torch.Generator().manual_seed(stage * 10 + world_size)
    groups = group_names(model)
    named = dict(model.named_parameters())
    params = {n: named[n].detach().clone() for group in groups for n in group}
    exp_avg = {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in params.items()}
    exp_avg_sq = {n: torch.rand(p.shape, generator=g) * 1e-4 for n, p in params.items()}
    module = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    module["head.weight"] = module["emb.weight"]  # one storage, as torch.save keeps tied weights
    truth = Truth(params, exp_avg, exp_avg_sq, module, tag_dir)
    if stage == 0:
        _write_stage0(tag_dir, model, truth, world_size)
    elif stage in (1, 2):
        _write_stage12(tag_dir, model, truth, stage, world_size)
    else:
        _write_stage3(tag_dir, model, truth, world_size)
    return truth


def _write_stage0(tag_dir: Path, model: nn.Module, truth: Truth, world_size: int) -> None:
    # torch numbers the optimizer's parameters group after group; nothing records their names.
    order = [n for group in group_names(model) for n in group]
    index = {n: i for i, n in enumerate(order)}
    state = {index[n]: {"step": torch.tensor(float(STEP)), "exp_avg": truth.exp_avg[n],
                        "exp_avg_sq": truth.exp_avg_sq[n]} for n in order}
    groups = _adam_groups(model, [[index[n] for n in group] for group in group_names(model)])
    _save({"module": truth.module, "optimizer": {"state": state, "param_groups": groups}, "param_shapes": None,
           "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None,
           **_common(model, 0, world_size)}, tag_dir / "mp_rank_00_model_states.pt")


def _model_states(model: nn.Module, truth: Truth, stage: int, world_size: int, module: Any) -> dict[str, Any]:
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    return {"module": module, "optimizer": None,
            "param_shapes": [OrderedDict((n, truth.params[n].shape) for n in group) for group in group_names(model)],
            "frozen_param_shapes": OrderedDict((n, p.shape) for n, p in frozen.items()),
            "shared_params": {"head.weight": "emb.weight"},
            "frozen_param_fragments": OrderedDict((n, p.detach().clone()) for n, p in frozen.items()),
            **_common(model, stage, world_size)}


def _write_stage12(tag_dir: Path, model: nn.Module, truth: Truth, stage: int, world_size: int) -> None:
    """Each group flat, a padding after its second parameter (as DeepSpeed's alignment may put),
    the end padded to a multiple of 2 x ranks, cut into equal rank parts."""
    groups = group_names(model)
    paddings = [[3 if i == 1 else 0 for i in range(len(group))] for group in groups]
    parts: dict[str, list[list[torch.Tensor]]] = {}
    group_paddings = []
    for kind, values in (("param", truth.params), ("exp_avg", truth.exp_avg), ("exp_avg_sq", truth.exp_avg_sq)):
        per_group = []
        for group, pads in zip(groups, paddings):
            pieces = [t for n, pad in zip(group, pads) for t in (values[n].reshape(-1), torch.zeros(pad))]
            flat = torch.cat(pieces)
            total = math.ceil(flat.numel() / (2 * world_size)) * 2 * world_size
            group_paddings.append(total - flat.numel())
            per_group.append(list(torch.cat([flat, torch.zeros(total - flat.numel())]).chunk(world_size)))
        parts[kind] = per_group
    _save(_model_states(model, truth, stage, world_size, truth.module), tag_dir / "mp_rank_00_model_states.pt")
    for rank in range(world_size):
        state = {i: {"step": torch.tensor(float(STEP)), "exp_avg": parts["exp_avg"][i][rank].clone(),
                     "exp_avg_sq": parts["exp_avg_sq"][i][rank].clone()} for i in range(len(groups))}
        last = rank == world_size - 1
        _save({"optimizer_state_dict": {
            "loss_scaler": LossScaler(cur_scale=1.0, dynamic=False), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": 1.0, "base_optimizer_state": {"state": state, "param_groups": _adam_groups(
                model, [[i] for i in range(len(groups))])},
            "single_partition_of_fp32_groups": [parts["param"][i][rank].clone() for i in range(len(groups))],
            "zero_stage": ZeroStageEnum(stage),
            "group_paddings": [group_paddings[i] if last else 0 for i in range(len(groups))],
            "param_alignment_paddings": paddings, "partition_count": [world_size] * len(groups),
            "ds_version": "0.19.8",
            "param_slice_mappings": [OrderedDict({groups[i][0]: FragmentAddress(1, 0)}) for i in range(len(groups))],
        }, "ds_config": _common(model, stage, world_size)["ds_config"], "ds_version": "0.19.8"},
            tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _rank_part(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Stage 3: rank `rank`'s ceil(numel / ranks) elements of one parameter, the last padded."""
    part = math.ceil(tensor.numel() / world_size)
    flat = torch.cat([tensor.reshape(-1), torch.zeros(part * world_size - tensor.numel())])
    return flat[rank * part: (rank + 1) * part].clone()


def _write_stage3(tag_dir: Path, model: nn.Module, truth: Truth, world_size: int) -> None:
    groups = group_names(model)
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    module = OrderedDict((k, torch.empty(0) if k in truth.params or k in frozen or k == "head.weight" else v)
                         for k, v in truth.module.items())
    for rank in range(world_size):
        states = _model_states(model, truth, 3, world_size, module)
        states["frozen_param_fragments"] = OrderedDict((n, _rank_part(p, rank, world_size)) for n, p in frozen.items())
        _save(states, tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        flat = {kind: [torch.cat([_rank_part(values[n], rank, world_size) for n in group]) for group in groups]
                for kind, values in (("param", truth.params), ("exp_avg", truth.exp_avg),
                                     ("exp_avg_sq", truth.exp_avg_sq))}
        state = {i: {"step": torch.tensor(float(STEP)), "exp_avg": flat["exp_avg"][i],
                     "exp_avg_sq": flat["exp_avg_sq"][i]} for i in range(len(groups))}
        _save({"optimizer_state_dict": {
            "zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(cur_scale=1.0, dynamic=False),
            "dynamic_loss_scale": False, "overflow": False, "partition_count": world_size,
            "optimizer_state_dict": {"state": state, "param_groups": _adam_groups(model, [[i] for i in range(len(groups))])},
            "fp32_flat_groups": flat["param"]}, "ds_version": "0.19.8"},
            tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
