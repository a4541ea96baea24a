"""Shared pieces of the layout-invariant tests: one training run of the demo GPT in the mode, on
the global batches every layout shares, and its state made logical (whole parameters, whole
optimizer state) so runs of different layouts compare with torch.equal."""

from __future__ import annotations

from typing import Any

import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import GPT, gpt_config
from zerodist.zero.canonical import micro_batch_index

MICROS = 8  # K micro-batches per global batch, in every layout
MICRO_ROWS = 2


def mode_config(stage: int, accumulation: int, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_ROWS,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 0.1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096},
        "zerodist": {"deterministic": "layout_invariant"},
        "steps_per_print": 10**9,
    }
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(config.get(key), dict) else value
    return config


def global_tokens(step: int, vocab: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randint(0, vocab, (MICROS * MICRO_ROWS, seq + 1), generator=g)


def my_micro_batches(step: int, engine: Any, vocab: int, seq: int, llama: bool = False) -> list[Any]:
    """The hand-fed rule: micro-batch k is rows k*micro.. of the global batch; this data rank feeds
    micro_batch_index(rank, j, ...) at its accumulation step j."""
    tokens = global_tokens(step, vocab, seq)
    data, rank = engine.topology.num_batch_shards, engine.topology.batch_rank
    accumulation = engine.batch.gradient_accumulation_steps
    shard = engine.zero_state.sharding.shard_gradients
    batches = []
    for j in range(accumulation):
        k = micro_batch_index(rank, j, data, accumulation, shard)
        rows = tokens[k * MICRO_ROWS: (k + 1) * MICRO_ROWS]
        batches.append({"input_ids": rows, "labels": rows} if llama else (rows[:, :-1], rows[:, 1:]))
    return batches


def logical_optimizer_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's AdamW state, whole, the same on every rank (a sum of disjoint pieces)."""
    zero = engine.zero_state
    state = zero.inner_optimizer.state
    result: dict[str, torch.Tensor] = {}
    for group in zero.groups:
        views, layout = group.views, group.layout
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(layout.total_numel, dtype=torch.float32)
            for index, tensor in enumerate(group.optimizer_tensors):
                views.stepped(index, full).copy_(state[tensor][key])
            if views.sharded_steps:
                comm.all_reduce(full, group=group.group)  # x + 0: exact
            for record, slot in zip(group.records, layout.slots):
                result[f"{record.name}.{key}"] = full[slot.offset: slot.offset + slot.numel].clone()
        steps = {float(state[t]["step"]) for t in group.optimizer_tensors}
        result[f"group{id(group)}.step"] = torch.tensor(sorted(steps))
    return {k: v for k, v in result.items() if not k.startswith("group")} | {
        "steps": torch.tensor(sorted({float(v) for k, v in result.items() if k.startswith("group")}))}


def make_model(kind: str) -> tuple[torch.nn.Module, int, int]:
    """The model of `kind` ("gpt": the tiny demo GPT, "llama": tests/hf_models.py's), its vocabulary
    and sequence length."""
    torch.manual_seed(0)
    if kind == "llama":
        from tests.hf_models import SEQ, VOCAB, hf_class, hf_config

        return hf_class("llama")(hf_config("llama")), VOCAB, SEQ - 1
    cfg = gpt_config("tiny")
    if kind.startswith("moe"):  # "moe-ep2": the MoE GPT's experts over 2 expert ranks
        from zerodist.models.moe_gpt import MoEConfig, MoEGPT

        ep = int(kind[len("moe-ep"):]) if kind.startswith("moe-ep") else 1
        return MoEGPT(cfg, MoEConfig(num_experts=4, ep_size=ep, capacity_factor=1.0, min_capacity=0)), \
            cfg.vocab_size, cfg.seq_len
    return GPT(cfg), cfg.vocab_size, cfg.seq_len


def train_in_mode(stage: int, steps: int = 10, kind: str = "gpt", *, first_step: int = 0, load: str | None = None,
                  save: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Train `kind`'s model `steps` steps in the mode on this world (data degree = world size,
    accumulation = MICROS / data degree), from global batch `first_step` (after loading the
    checkpoint in `load`, then saving one in `save`); the logical result, the same on every rank."""
    tensor = overrides.get("zerodist", {}).get("tensor_parallel", {}).get("size", 1)
    data = comm.get_world_size() // tensor
    model, vocab, seq = make_model(kind)
    engine, _, _, _ = zerodist.initialize(model=model, config=mode_config(stage, MICROS // data, **overrides))
    if load is not None:
        engine.load_checkpoint(load)
    losses, clipped = [], 0
    for step in range(first_step, first_step + steps):
        losses.append(engine.train_batch(iter(my_micro_batches(step, engine, vocab, seq, llama=kind == "llama"))))
        clipped += engine.last_step.clip_coef < 1.0
    if save is not None:
        engine.save_checkpoint(save)
    optimizer = logical_optimizer_state(engine) if tensor == 1 else {}
    if kind.startswith("moe"):  # an expert's state is under its local name: the dense parameters' only
        optimizer = {k: v for k, v in optimizer.items() if "experts" not in k}
    result = {"params": engine.module_state_dict(), "optimizer": optimizer,
              "losses": torch.stack(losses), "clipped_steps": clipped}
    engine.destroy()
    return result


def assert_bitwise(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for part in ("params", "optimizer"):
        assert actual[part].keys() == expected[part].keys(), part
        differing = [k for k in expected[part] if not torch.equal(actual[part][k], expected[part][k])]
        assert not differing, f"{part}: {len(differing)} differ, e.g. {differing[:3]}"
    assert torch.equal(actual["losses"], expected["losses"]), (actual["losses"], expected["losses"])
