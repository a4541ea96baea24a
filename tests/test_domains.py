"""Sharding domains: parameters declared EXPERT on a data=2 x expert=2 mesh reduce and shard over
("data",) only, against one process holding every expert ([Note: sharding domains])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.comm import DENSE, EXPERT
from zerodist.comm.domains import declare_expert_parallel, declare_logical_offset, declare_placement, logical_names
from tests.harness import distributed_test, run_distributed

IN_DIM, HIDDEN, OUT_DIM, MICRO = 16, 32, 8, 4
NUM_EXPERTS = 2
STEPS = 4
CLIP = 0.3


class Block(torch.nn.Module):
    """A dense layer, then the routed expert: each rank runs its own expert."""

    def __init__(self, num_local: int):
        super().__init__()
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(num_local)])

    def forward(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        h = h + torch.tanh(self.dense(h))
        return h + torch.tanh(self.experts[expert](h))


class ExpertNet(torch.nn.Module):
    """`num_local` experts per block, logically experts `offset ...`; built for `ep_size` expert ranks."""

    def __init__(self, num_local: int, offset: int = 0, ep_size: int = 1, num_blocks: int = 2):
        super().__init__()
        self.inp = torch.nn.Linear(IN_DIM, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block(num_local) for _ in range(num_blocks)])
        self.out = torch.nn.Linear(HIDDEN, OUT_DIM)
        for block in self.blocks:
            declare_placement(block.experts, EXPERT)
            declare_logical_offset(block.experts, offset)
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
    """This rank's part of `full_model()`: the dense layers and expert `expert_rank`."""
    full = full_model().state_dict()
    model = ExpertNet(NUM_EXPERTS // ep_size, offset=expert_rank * NUM_EXPERTS // ep_size, ep_size=ep_size)
    names = logical_names(model)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(full[names[id(param)]])
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
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for rank in range(world_size):
            x, y = batch(step, rank)
            losses.append(F.mse_loss(model(x, expert=rank % NUM_EXPERTS), y))
        torch.stack(losses).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(engine, steps: int, first_step: int = 0) -> None:
    rank = comm.get_rank()
    for step in range(first_step, first_step + steps):
        x, y = batch(step, rank)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


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
        assert dict(topology.degrees) == {"data": 2, "expert": 2, "tensor": 1}
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
            err = float((value.double() - ref_state[name].double()).norm() / ref_state[name].double().norm())
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
