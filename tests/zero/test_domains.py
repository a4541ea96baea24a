"""Sharding domains: parameters declared EXPERT on a data=2 x expert=2 mesh reduce and shard over
("data",) only, against one process holding every expert ([Note: sharding domains])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.comm import DENSE, EXPERT
from zerodist.comm.domains import (Placement, declare_expert_parallel, declare_logical_offset, declare_placement,
                                   logical_keys, logical_names)
from tests.harness import distributed_test, run_distributed

pytestmark = pytest.mark.multiprocess

IN_DIM, HIDDEN, OUT_DIM, MICRO = 16, 32, 8, 4
NUM_EXPERTS = 2
STEPS = 4
CLIP = 0.3


class Block(torch.nn.Module):
    """A dense layer, then the routed expert, then the routed expert's columns of a `mix` weight
    whose logical shape is [HIDDEN, HIDDEN]: each expert rank holds only its experts' columns (a
    slice along dimension 1 over the expert axis), so the checkpoint reshards a dim-1 slicing."""

    def __init__(self, num_local: int, offset: int):
        super().__init__()
        self.offset, self.width = offset, HIDDEN // NUM_EXPERTS
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(num_local)])
        for k, expert in enumerate(self.experts):  # a buffer of each expert's own: initialize must keep it
            expert.register_buffer("gain", torch.tensor(1.0 + 0.5 * (offset + k)))
        self.mix = torch.nn.Parameter(0.1 * torch.randn(HIDDEN, self.width * num_local))

    def forward(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        h = h + torch.tanh(self.dense(h))
        h = h + torch.tanh(self.experts[expert](h)) * self.experts[expert].gain
        columns = slice((self.offset + expert) * self.width, (self.offset + expert + 1) * self.width)
        mixed = torch.tanh(h @ self.mix[:, expert * self.width: (expert + 1) * self.width])
        return torch.cat([h[:, :columns.start], h[:, columns] + mixed, h[:, columns.stop:]], dim=1)


class ExpertNet(torch.nn.Module):
    """`num_local` experts per block, logically experts `offset ...`; built for `ep_size` expert ranks."""

    def __init__(self, num_local: int, offset: int = 0, ep_size: int = 1, num_blocks: int = 2):
        super().__init__()
        self.inp = torch.nn.Linear(IN_DIM, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block(num_local, offset) for _ in range(num_blocks)])
        self.out = torch.nn.Linear(HIDDEN, OUT_DIM)
        for block in self.blocks:
            declare_placement(block.experts, EXPERT)
            declare_logical_offset(block.experts, offset)
            sliced = Placement(EXPERT, slice_dim=1, slice_axis="expert") if ep_size > 1 else Placement(EXPERT)
            declare_placement(block, sliced, names=["mix"])
        declare_expert_parallel(self, ep_size)

    def forward(self, x: torch.Tensor, expert: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h, expert)
        return self.out(h)


def full_model() -> ExpertNet:
    torch.manual_seed(0)
    return ExpertNet(NUM_EXPERTS)


def local_model(expert_rank: int, ep_size: int) -> ExpertNet:
    """This rank's part of `full_model()`: the dense layers, its experts and their mix columns."""
    full = full_model().state_dict()
    model = ExpertNet(NUM_EXPERTS // ep_size, offset=expert_rank * NUM_EXPERTS // ep_size, ep_size=ep_size)
    state = {}
    for key, logical in logical_keys(model).items():
        value = full[logical]
        if value.shape != model.state_dict()[key].shape:  # a slice along dim 1: this expert rank's columns
            value = torch.chunk(value, ep_size, dim=1)[expert_rank]
        state[key] = value
    model.load_state_dict(state)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return torch.randn(MICRO, IN_DIM, generator=g), torch.randn(MICRO, OUT_DIM, generator=g)


def config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500, "allgather_bucket_size": 1500,
                                  "stage3_param_persistence_threshold": 40, **zero},
            "zerodist": {"stage3_unit_classes": ["Block"]}}


def reference(world_size: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, every expert; rank r's micro-batch goes through expert r % E; loss averaged over ranks."""
    model = full_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms = [reference_step(model, optimizer, step, world_size) for step in range(steps)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def reference_step(model: ExpertNet, optimizer: torch.optim.Optimizer, step: int, world_size: int) -> float:
    """One step of the one-process reference on `world_size` ranks' micro-batches (rank r through
    expert r % E, losses averaged); returns the gradient norm before clipping."""
    optimizer.zero_grad()
    losses = []
    for rank in range(world_size):
        x, y = batch(step, rank)
        losses.append(F.mse_loss(model(x, expert=rank % NUM_EXPERTS), y))
    torch.stack(losses).mean().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    return norm


def train(engine, steps: int, first_step: int = 0, expert: int = 0) -> None:
    """This rank's micro-batches through its local expert `expert`."""
    rank = comm.get_rank()
    for step in range(first_step, first_step + steps):
        x, y = batch(step, rank)
        engine.backward(F.mse_loss(engine(x, expert=expert), y))
        engine.step()


def part_of(logical: torch.Tensor, local: torch.Tensor, expert_rank: int, ep_size: int) -> torch.Tensor:
    """The part of a logical tensor a rank holds: its columns of a sliced `mix`, else all of it."""
    return logical if logical.shape == local.shape else torch.chunk(logical, ep_size, dim=1)[expert_rank]


def logical_state(engine) -> dict[str, torch.Tensor]:
    names = logical_names(engine.module)
    with zerodist.zero.GatheredParameters(list(engine.module.parameters()), enabled=engine.stage3 is not None):
        return {names[id(p)]: p.detach().clone() for p in engine.module.parameters()}


def expected_state_bytes(engine) -> dict[str, int]:
    """fp32 AdamW: 4 bytes of parameters, 4 of gradients, 8 of optimizer state per element; each
    kind a 1/N share when sharded, N being the size of the group's *own* domain."""
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    for group in engine.groups:
        psi, n, policy = group.layout.total_numel, group.world_size, group.policy
        totals["params"] += 4 * psi // (n if policy.shard_parameters else 1)
        totals["grads"] += 4 * psi // (n if policy.shard_gradients else 1)
        totals["optimizer"] += 8 * psi // (n if policy.shard_optimizer_state else 1)
    return totals


@distributed_test(world_size=4, timeout=240)
def test_expert_parameters_live_on_the_data_group_at_every_stage():
    ref_state, ref_norms = reference(4, STEPS)
    assert ref_norms[-1] > CLIP  # clipping is active: a wrong norm would move the parameters
    finals = []
    for stage in (0, 1, 2, 3):
        engine, *_ = zerodist.initialize(model=local_model(comm.get_rank() % 2, 2), config=config(stage))
        topology = engine.topology
        assert dict(topology.degrees) == {"pipe": 1, "data": 2, "expert": 2, "sequence": 1, "tensor": 1}
        domains = {g.domain for g in engine.groups}
        assert domains == {DENSE, EXPERT}
        assert {g.world_size for g in engine.groups if g.domain == EXPERT} == {2}
        assert {g.world_size for g in engine.groups if g.domain == DENSE} == {4}
        if stage == 3:  # a unit holds groups of both domains
            assert all({g.domain for g in unit.groups} == {DENSE, EXPERT} for unit in engine.stage3.units[1:])
        train(engine, STEPS - 1)
        with comm.trace() as trace:
            train(engine, 1, first_step=STEPS - 1)
        _check_traffic(engine, trace, stage)
        assert engine.get_global_grad_norm() == pytest.approx(ref_norms[-1], rel=1e-5)
        state = logical_state(engine)
        for name, value in state.items():
            expected = part_of(ref_state[name], value, comm.get_rank() % 2, 2).double()
            err = float((value.double() - expected).norm() / expected.norm())
            assert err <= 1e-6, f"stage {stage}: {name} relative error {err:.2e}"
        actual = engine.model_state_bytes()
        assert {k: actual[k] for k in ("params", "grads", "optimizer")} == expected_state_bytes(engine)
        finals.append(state)
        engine.destroy()
    for stage, state in enumerate(finals[1:], start=1):
        for name, value in state.items():
            assert torch.equal(value, finals[0][name]), f"stage {stage} differs from stage 0 at {name}"


def _check_traffic(engine, trace, stage: int) -> None:
    """Gradients (and, sharded, parameters) of expert groups move over groups of 2 ranks only,
    the dense ones over all 4; bytes exactly the groups' padded sizes."""
    expert = sum(g.layout.total_numel for g in engine.groups if g.domain == EXPERT)
    dense = sum(g.layout.total_numel for g in engine.groups if g.domain == DENSE)
    reductions = [r for r in trace.records if r.op in ("all_reduce", "reduce_scatter") and r.dtype == torch.float32]
    by_size: dict[int, int] = {}
    for record in reductions:
        by_size[record.group_size] = by_size.get(record.group_size, 0) + record.num_bytes
    assert by_size == {2: 4 * expert, 4: 4 * dense}, (stage, by_size)
    step_stats = [r for r in trace.records if r.op == "all_reduce" and r.dtype == torch.float64]
    assert [r.group_size for r in step_stats] == [4]  # one all-reduce over the world: norm, overflow, checks
    gathers: dict[int, int] = {}
    for record in trace.records:
        if record.op == "all_gather":
            gathers[record.group_size] = gathers.get(record.group_size, 0) + record.numel
    if stage == 0:
        assert gathers == {}
    elif stage in (1, 2):  # the updated shards, once per step
        assert gathers == {2: expert, 4: dense}
    else:
        assert set(gathers) == {2, 4}  # units gathered per use, each domain over its own group


def _save_on_four_ranks(save_dir: str) -> dict[str, torch.Tensor]:
    engine, *_ = zerodist.initialize(model=local_model(comm.get_rank() % 2, 2), config=config(3))
    train(engine, STEPS)
    engine.save_checkpoint(save_dir, tag="four")
    state = logical_state(engine)
    engine.destroy()
    return state


def _load_on_two_ranks(save_dir: str, ep_size: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """data=1 x expert=2 (each rank one expert, its mix columns), or data=2 x expert=1 (each rank
    every expert and the whole mix); rank r's batches through expert r either way."""
    rank = comm.get_rank()
    engine, *_ = zerodist.initialize(model=local_model(rank if ep_size == 2 else 0, ep_size), config=config(stage))
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2 // ep_size, "expert": ep_size, "sequence": 1, "tensor": 1}
    engine.load_checkpoint(save_dir, tag="four")
    assert engine.global_steps == STEPS
    loaded = logical_state(engine)
    train(engine, 2, first_step=STEPS, expert=0 if ep_size == 2 else rank)
    state = logical_state(engine)
    engine.destroy()
    return {"loaded": loaded, "continued": state}


def _continue_reference(params: dict, exp_avg: dict, exp_avg_sq: dict, world_size: int, steps: int) -> dict:
    """The one-process model and AdamW from the consolidated checkpoint, `steps` more steps with
    `world_size` ranks' micro-batches (rank r through expert r % E)."""
    model = full_model()
    model.load_state_dict(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for name, param in model.named_parameters():
        optimizer.state[param] = {"step": torch.tensor(float(STEPS)), "exp_avg": exp_avg[name].clone(),
                                  "exp_avg_sq": exp_avg_sq[name].clone()}
    for step in range(STEPS, STEPS + steps):
        reference_step(model, optimizer, step, world_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_expert_checkpoint_reloads_into_another_mesh(tmp_path):
    """Saved on data=2 x expert=2 (stage 3), loaded on data=1 x expert=2 (stage 2) and on
    data=2 x expert=1 (stage 1): each rank finds its experts by global id and its part of the
    dim-1-sliced `mix`, the consolidated checkpoint is the one-process model with every expert,
    and training continues as one process would."""
    from zerodist.checkpoint import consolidate_checkpoint, read_manifest

    saved = run_distributed(_save_on_four_ranks, 4, str(tmp_path), timeout=180)
    manifest = read_manifest(tmp_path / "four")
    assert manifest.params["blocks.0.experts.1.weight"]["shape"] == [HIDDEN, HIDDEN]
    assert manifest.params["blocks.0.experts.1.weight"]["placement"]["reduce_axes"] == ["data", "sequence"]
    assert manifest.params["blocks.0.dense.weight"]["placement"]["reduce_axes"] == ["data", "expert", "sequence"]
    mix = manifest.params["blocks.1.mix"]
    assert mix["shape"] == [HIDDEN, HIDDEN]
    assert (mix["placement"]["slice_dim"], mix["placement"]["slice_axis"], mix["placement"]["num_parts"]) == (
        1, "expert", 2)
    params = consolidate_checkpoint(tmp_path)
    ref_state, _ = reference(4, STEPS)
    assert params.keys() == ref_state.keys()  # both experts, by logical name; the whole mix
    for name, value in params.items():
        assert torch.allclose(value, ref_state[name], rtol=1e-5, atol=1e-7), name
    for rank, state in enumerate(saved):  # the checkpoint holds what each rank trained
        for name, value in state.items():
            assert torch.equal(part_of(params[name], value, rank % 2, 2), value), (rank, name)
    expected = _continue_reference(params, consolidate_checkpoint(tmp_path, kind="optimizer.exp_avg"),
                                   consolidate_checkpoint(tmp_path, kind="optimizer.exp_avg_sq"), 2, 2)
    for ep_size, stage in ((2, 2), (1, 1)):
        results = run_distributed(_load_on_two_ranks, 2, str(tmp_path), ep_size, stage, timeout=180)
        for rank, result in enumerate(results):
            experts = {n.split(".")[3] for n in result["loaded"] if ".experts." in n}
            assert experts == ({str(rank)} if ep_size == 2 else {"0", "1"})
            for name, value in result["loaded"].items():
                assert torch.equal(value, part_of(params[name], value, rank, ep_size)), (ep_size, rank, name)
            for name, value in result["continued"].items():
                target = part_of(expected[name], value, rank, ep_size).double()
                err = float((value.double() - target).norm() / target.norm())
                assert err <= 1e-6, f"expert={ep_size}, rank {rank}: {name} relative error {err:.2e}"


@distributed_test(world_size=4)
def test_gathered_parameters_publish_each_expert_group_from_the_modifier_s_peer():
    """modifier_rank=0: the dense group takes rank 0's changes; the expert group {1, 3} (expert 1),
    which rank 0 is not in, takes those of rank 1, its member standing where rank 0 stands."""
    rank = comm.get_rank()
    engine, *_ = zerodist.initialize(model=local_model(rank % 2, 2), config=config(3))
    block = engine.module.blocks[0]
    params = [block.dense.weight, block.experts[0].weight]
    with zerodist.zero.GatheredParameters(params, modifier_rank=0):
        with torch.no_grad():
            block.dense.weight.fill_(10.0 + rank)
            block.experts[0].weight.fill_(20.0 + rank)
    with zerodist.zero.GatheredParameters(params):
        assert bool((block.dense.weight == 10.0).all())
        assert bool((block.experts[0].weight == 20.0 + rank % 2).all())
    engine.destroy()
