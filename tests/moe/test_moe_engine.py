"""MoE through zerodist.initialize at every ZeRO stage against one process at ep_size=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodist
import zerodist.comm as comm
from tests.engine_helpers import assert_close_relative, base_config
from tests.harness import distributed_test
from zerodist.moe.layer import MoE

pytestmark = pytest.mark.multiprocess

IN_DIM, HIDDEN, OUT_DIM, NUM_EXPERTS, MICRO, STEPS, AUX_COEF = 6, 8, 4, 4, 6, 5, 0.1


class MoEModel(nn.Module):
    """Linear -> MoE -> Linear, with a dense parameter and a buffer whose names contain 'expert'."""

    def __init__(self, ep_size: int, expert_rank: int, **options):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN_DIM, HIDDEN)
        self.expert_bias = nn.Parameter(torch.zeros(HIDDEN))
        self.register_buffer("experts_mask", torch.ones(HIDDEN))
        self.moe = MoE(HIDDEN, nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN)),
                       num_experts=NUM_EXPERTS, ep_size=ep_size, **options)
        self.out = nn.Linear(HIDDEN, OUT_DIM)
        local = NUM_EXPERTS // ep_size
        with torch.no_grad():  # distinct experts; expert g's values depend on g only
            for index, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                generator = torch.Generator().manual_seed(50 + expert_rank * local + index)
                for param in expert.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x, y):
        output, l_aux, _ = self.moe(self.inp(x) + self.expert_bias)
        return F.mse_loss(self.out(output * self.experts_mask), y) + AUX_COEF * l_aux


def _batch(step: int, shard: int):
    generator = torch.Generator().manual_seed(1000 + 10 * step + shard)
    return torch.randn(MICRO, IN_DIM, generator=generator), torch.randn(MICRO, OUT_DIM, generator=generator)


def _reference(num_shards: int, options: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = MoEModel(1, 0, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for shard in range(num_shards):
            model.moe.set_routing_key(shard=shard, step=step)
            losses.append(model(*_batch(step, shard)))
        (sum(losses) / num_shards).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(stage: int, ep_size: int, options: dict, steps: int = STEPS, **config):
    expert_rank = comm.get_rank() % ep_size
    model = MoEModel(ep_size, expert_rank, **options)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage, **config))
    shard = engine.topology.batch_rank
    for step in range(steps):
        loss = engine(*_batch(step, shard))
        engine.backward(loss)
        engine.step()
    return engine, engine.module_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("k, drop_tokens", [(1, True), (1, False), (2, True), (2, False)])
@distributed_test(world_size=2)
def test_ep2_training_matches_one_process(stage, k, drop_tokens):
    options = dict(k=k, drop_tokens=drop_tokens, capacity_factor=0.75, min_capacity=0)
    engine, state = _train(stage, 2, options)
    assert engine.topology.size("expert") == 2
    assert_close_relative(state, _reference(2, options), 1e-6)


@pytest.mark.parametrize("stage", [0, 3])
@distributed_test(world_size=4)
def test_data2_expert2_matches_one_process(stage):
    options = dict(k=2, drop_tokens=True, capacity_factor=0.75, min_capacity=0)
    engine, state = _train(stage, 2, options, steps=3)
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2, "expert": 2, "sequence": 1, "tensor": 1}
    assert_close_relative(state, _reference(4, options, steps=3), 1e-6)


class _BiasExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return x * 0 + self.w


class _NormModel(nn.Module):
    """Tokens [1, 0] go to expert 0 (on rank 0), [0, 1] to expert 1 (rank 1), with gate 1.0."""

    def __init__(self):
        super().__init__()
        self.moe = MoE(2, _BiasExpert(), num_experts=2, ep_size=2, k=1, drop_tokens=False)
        self.moe.deepspeed_moe.gate.wg.weight.data.copy_(torch.tensor([[100.0, 0.0], [0.0, 100.0]]))
        self.moe.deepspeed_moe.gate.wg.weight.requires_grad_(False)

    def forward(self, x, c):
        return (self.moe(x)[0] * c).sum()


@pytest.mark.parametrize("stage", [0, 2, 3])
@distributed_test(world_size=2)
def test_gradient_norm_counts_each_expert_once(stage):
    # Two tokens per rank; after the engine's mean over the 2 batch shards, expert 0's gradient is
    # [4, 2] (squared norm 20) and expert 1's [6, 8] (squared norm 100): the norm is sqrt(120),
    # where averaging per-rank norms (DeepSpeed #8475) would give 7.24.
    rank = comm.get_rank()
    engine, _, _, _ = zerodist.initialize(model=_NormModel(), config=base_config(stage, gradient_clipping=1e6))
    x = torch.eye(2)[rank].repeat(2, 1)
    c = torch.tensor([[4.0, 2.0], [6.0, 8.0]])[rank]
    engine.backward(engine(x, c))
    engine.step()
    assert engine.get_global_grad_norm() == pytest.approx(120 ** 0.5, rel=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
@distributed_test(world_size=4)
def test_traffic_four_all_to_alls_of_e_c_m_and_expert_grads_over_data_only(stage):
    options = dict(k=1, drop_tokens=True, capacity_factor=1.0, min_capacity=0)
    model = MoEModel(2, comm.get_rank() % 2, **options)
    expert_numel = sum(p.numel() for p in model.moe.deepspeed_moe.experts.parameters())
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage))
    with comm.trace() as trace:
        engine.backward(engine(*_batch(0, engine.topology.batch_rank)))
        engine.step()
    capacity = -(-MICRO // NUM_EXPERTS)
    to_all = [r for r in trace.records if r.op == "all_to_all"]
    assert [r.numel for r in to_all] == [NUM_EXPERTS * capacity * HIDDEN] * 4
    assert all(r.group_size == 2 for r in to_all)
    # Expert gradients are reduced over ("data",) (2 ranks) only; every other reduction of
    # gradients runs over data x expert (4 ranks), plus the step's one world all-reduce.
    reductions = [r for r in trace.records if r.op in ("all_reduce", "reduce_scatter")]
    over_data = sum(r.numel for r in reductions if r.group_size == 2)
    assert expert_numel <= over_data < expert_numel + 2 * 64  # bucket padding at most
    assert all(r.group_size in (2, 4) for r in reductions)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@distributed_test(world_size=2)
def test_user_ids_survive_and_nothing_is_written_on_the_model(stage):
    model = MoEModel(2, comm.get_rank(), k=2)
    for index, module in enumerate(model.modules()):
        module.id = 1000 + index
    for index, param in enumerate(model.parameters()):
        param.id = f"param-{index}"
    module_attrs = [set(vars(m)) for m in model.modules()]
    param_attrs = [dict(vars(p)) for p in model.parameters()]
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(stage))
    engine.backward(engine(*_batch(0, comm.get_rank())))
    engine.step()
    assert [m.id for m in model.modules()] == [1000 + i for i in range(len(module_attrs))]
    assert [set(vars(m)) for m in model.modules()] == module_attrs
    assert [dict(vars(p)) for p in model.parameters()] == param_attrs


@distributed_test(world_size=2)
def test_layers_with_different_ep_sizes_are_named():
    from zerodist.comm import TopologyError

    model = nn.ModuleDict({"first": MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=2),
                           "second": MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=1)})
    with pytest.raises(TopologyError, match="different expert-parallel degrees .first: 2, second: 1"):
        zerodist.initialize(model=model, config=base_config(0))


@distributed_test(world_size=2)
def test_aux_loss_free_counts_are_summed_over_batch_shards_and_saved():
    rank = comm.get_rank()
    model = MoEModel(2, rank, k=1, load_balance_coeff=0.01)
    gate = model.moe.deepspeed_moe.gate
    with torch.no_grad():  # every token of rank r goes to expert r: global counts [6, 6, 0, 0]
        model.inp.weight.zero_()
        model.inp.bias.zero_()
        model.inp.weight[0, 0] = 1.0
        gate.wg.weight.zero_()
        gate.wg.weight[0, 0], gate.wg.weight[1, 0] = 5.0, -5.0
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(0, optimizer={"type": "SGD", "params": {"lr": 0.0}}))
    x, y = _batch(0, rank)
    x[:, 0] = 1.0 if rank == 0 else -1.0
    engine.backward(engine(x, y))
    engine.step()
    assert gate.expert_bias.tolist() == pytest.approx([-0.01, -0.01, 0.01, 0.01])
    assert torch.equal(engine.module_state_dict()["moe.deepspeed_moe.gate.expert_bias"], gate.expert_bias)


@distributed_test(world_size=2)
def test_deepspeed_style_moe_param_groups_train_the_same():
    from zerodist.moe.utils import split_params_into_different_moe_groups_for_optimizer

    options = dict(k=1, drop_tokens=True, capacity_factor=0.75, min_capacity=0)
    model = MoEModel(2, comm.get_rank(), **options)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "parameters"}])
    assert [g.get("moe", False) for g in groups] == [False, True]
    engine, _, _, _ = zerodist.initialize(model=model, model_parameters=groups, config=base_config(2))
    for step in range(STEPS):
        engine.backward(engine(*_batch(step, engine.topology.batch_rank)))
        engine.step()
    assert_close_relative(engine.module_state_dict(), _reference(2, options), 1e-6)


@distributed_test(world_size=2)
def test_experts_without_tokens_complete_the_step_at_stage3():
    model = MoEModel(2, comm.get_rank(), k=1, drop_tokens=False)
    with torch.no_grad():
        model.moe.deepspeed_moe.gate.wg.weight.zero_()  # equal gates, frozen: every token goes to expert 0
    model.moe.deepspeed_moe.gate.wg.weight.requires_grad_(False)
    engine, _, _, _ = zerodist.initialize(model=model, config=base_config(3, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    for step in range(2):
        engine.backward(engine(*_batch(step, engine.topology.batch_rank)))
        engine.step()
    assert model.moe.last_stats.exp_counts == (MICRO, 0, 0, 0)
    state = engine.module_state_dict()
    initial = {0: MoEModel(2, 0, k=1).moe.deepspeed_moe.experts.deepspeed_experts[0],
               3: MoEModel(2, 1, k=1).moe.deepspeed_moe.experts.deepspeed_experts[1]}
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    assert torch.equal(state[prefix + "3.0.weight"], initial[3][0].weight)  # never saw a token: untouched
    assert not torch.equal(state[prefix + "0.0.weight"], initial[0][0].weight)  # trained
