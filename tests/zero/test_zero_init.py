"""The served `deepspeed.zero.Init` (zerodist.runtime.zero): each module's parameters are cut to this
rank's shard as soon as the module is built ([Note: partitioned construction] in
zerodist/zero/init_shards.py), hold rank 0's values of the eager build, gather and re-cut through
`GatheredParameters`, and train after `initialize()` bit for bit as the eager build does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.models import make_mlp
from zerodist.runtime.zero import GatheredParameters, Init, register_external_parameter
from zerodist.zero import ShardedParameterError, init_shards, is_sharded
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test

CONFIG = base_config(3, zerodist={"stage3_unit_classes": ["Linear"]},
                     zero_optimization={"stage3_param_persistence_threshold": 0})


def built(make, **init):
    with Init(config_dict_or_path=CONFIG, **init):
        return make()


def full_values(model):
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model, steps=4, config=CONFIG):
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    n, rank, micro = comm.get_world_size(), comm.get_rank(), engine.batch.micro_batch_size
    losses = []
    for step in range(steps):
        x, y = global_batch(step, micro * n)
        loss = F.mse_loss(engine(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.module_state_dict()


def assert_same_run(run, eager_run):
    """`train`'s (losses, state) equal the eager build's, every loss and every tensor bit for bit."""
    (losses, state), (eager_losses, eager_state) = run, eager_run
    assert losses == eager_losses
    for key in eager_state:
        assert torch.equal(state[key], eager_state[key]), key


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_built_partitioned_holds_the_eager_values_and_trains_bitwise_equal(world_size):
    torch.manual_seed(3)
    model = built(lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 35),
                                              torch.nn.ReLU(), torch.nn.Linear(35, 8)))
    after = torch.get_rng_state()
    torch.manual_seed(3)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 35), torch.nn.ReLU(),
                                torch.nn.Linear(35, 8))
    assert torch.equal(after, torch.get_rng_state())  # the RNG moved on as in the eager build
    assert all(is_sharded(p) for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in eager.parameters())
    held = init_shards.partitioned_bytes(model)
    assert full / world_size <= held <= full / world_size + 5 * 4  # each parameter pads at most one element
    values = full_values(model)
    for name, param in eager.named_parameters():
        assert torch.equal(values[name], param), name
    assert all(is_sharded(p) for p in model.parameters())  # cut again after the gather
    run = train(model)
    assert not init_shards.holds_any(model)  # adopted by the engine
    assert_same_run(run, train(eager))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_rank_zeros_values_win_as_deepspeed_broadcasts_them(world_size):
    torch.manual_seed(comm.get_rank())  # ranks seeded apart: rank 0's build is the model
    model = built(lambda: torch.nn.Linear(6, 5))
    torch.manual_seed(0)
    reference = torch.nn.Linear(6, 5)
    values = full_values(model)
    assert torch.equal(values["weight"], reference.weight) and torch.equal(values["bias"], reference.bias)


class Layer(torch.nn.Module):
    cut_before: list[int] = []

    def __init__(self):
        super().__init__()
        Layer.cut_before.append(sum(init_shards.is_partitioned(p) for p in list(init_shards._SHARDS.keys())))
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_each_module_is_cut_before_the_next_is_built(world_size):
    """Inside `ModuleList([Layer() for ...])` too: the peak is about one module, not the model."""
    Layer.cut_before = []
    model = built(lambda: torch.nn.ModuleList([Layer() for _ in range(4)]))
    assert Layer.cut_before == [0, 4, 8, 12]  # each earlier layer's two Linears (weight, bias) already cut
    assert all(is_sharded(p) for p in model.parameters())


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_parameter_assigned_after_its_module_was_built_is_cut_too(world_size):
    def make():
        model = torch.nn.Linear(4, 4)
        model.extra = torch.nn.Parameter(torch.arange(6.0))  # outside any __init__, still in the block
        return model

    model = built(make)
    assert all(is_sharded(p) for p in model.parameters())
    assert torch.equal(full_values(model)["extra"], torch.arange(6.0))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_gathered_parameters_publishes_the_modifier_ranks_change_to_every_shard(world_size):
    model = built(lambda: make_mlp(seed=0))
    weight = model[0].weight
    with torch.no_grad(), GatheredParameters([weight], modifier_rank=0):
        assert not is_sharded(weight)
        with GatheredParameters(list(model.parameters())):  # nested: still whole after the inner block
            pass
        assert not is_sharded(weight)
        if comm.get_rank() == 0:
            weight.fill_(0.5)
    assert is_sharded(weight)
    with torch.no_grad(), GatheredParameters(weight):  # no modifier: changes are dropped
        weight.zero_()
    values = full_values(model)
    assert torch.equal(values["0.weight"], torch.full_like(values["0.weight"], 0.5))
    reference = make_mlp(seed=0)
    with torch.no_grad():
        reference[0].weight.fill_(0.5)
    assert_same_run(train(model, steps=2), train(reference, steps=2))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_partitioned_parameter_used_outside_a_gather_is_named(world_size):
    model = built(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    with pytest.raises(ShardedParameterError, match=r"'1\.weight' is a ZeRO-3 sharded parameter .*GatheredParameters"):
        model[1].weight.sum()
    with pytest.raises(ShardedParameterError, match=r"'0\.weight' .*torch.nn.functional.linear read it"):
        model(torch.ones(1, 4))
    assert tuple(model[1].weight.shape) == (2, 4)  # metadata stays readable
    assert "sharded by zerodist ZeRO-3 as '1.weight'" in repr(model[1].weight)


class ReadsAnother(torch.nn.Module):
    """A forward that reads another unit's weight without calling that unit."""

    def __init__(self, external: bool):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)
        if external:
            register_external_parameter(self, self.b.weight)
            register_external_parameter(self, self.b.bias)

    def forward(self, x):
        return self.a(x) @ self.b.weight.t() + self.b.bias


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_register_external_parameter_keeps_it_gathered_for_the_forward(world_size):
    torch.manual_seed(0)
    model = built(lambda: ReadsAnother(external=True))
    torch.manual_seed(0)
    eager = ReadsAnother(external=False)
    losses, state = train(model)
    # the eager model alone: one process, the whole batch (no external registration needed there)
    optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for step in range(4):
        x, y = global_batch(step, 4 * world_size)
        loss = F.mse_loss(eager(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    mean_losses = torch.tensor(losses)
    comm.all_reduce(mean_losses)
    assert (mean_losses / world_size).tolist() == pytest.approx(expected, abs=1e-6)
    for key, value in eager.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-6), key


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_register_external_parameter_under_zerodists_own_meta_init(world_size):
    """The table holds no weak reference to the parameter, so the meta build still materialises."""
    torch.manual_seed(0)
    with zerodist.zero.Init():
        model = ReadsAnother(external=False)
        zerodist.zero.register_external_parameter(model, model.b.weight)
        zerodist.zero.register_external_parameter(model, model.b.bias)
    run = train(model)
    torch.manual_seed(0)
    assert_same_run(run, train(ReadsAnother(external=True)))


@pytest.mark.unit
def test_register_external_parameter_refuses_what_is_not_a_module_and_parameter():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="an nn.Module and an nn.Parameter"):
        register_external_parameter(module, torch.ones(2))
    from zerodist.runtime.zero import unregister_external_parameter
    with pytest.raises(ValueError, match="was not registered"):
        unregister_external_parameter(module, module.weight)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 2])
@distributed_test(world_size=[2])
def test_other_stages_adopt_the_shards_and_frozen_parameters_too(world_size, stage):
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], "stage": stage}}

    def make():
        model = make_mlp(seed=0)
        model[0].bias.requires_grad_(False)
        return model

    model = built(make)
    assert is_sharded(model[0].bias)
    assert_same_run(train(model, config=config), train(make(), config=config))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_casting_a_partitioned_model_before_initialize_names_the_parameter(world_size):
    model = built(lambda: make_mlp(seed=0))
    with pytest.raises(ShardedParameterError, match=r"'0\.weight' is a ZeRO-3 sharded parameter"):
        model.to(torch.bfloat16)


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_conversion_that_changes_nothing_passes_and_trains_as_the_eager_build(world_size):
    # axolotl calls module.to(torch.float32) on the embeddings of a model built under zero.Init
    model = built(lambda: make_mlp(seed=0))
    assert model.to(torch.float32) is model and model.to("cpu") is model
    assert model[0].weight.type(torch.FloatTensor) is model[0].weight
    with pytest.raises(ShardedParameterError, match=r"'0\.weight' .* torch\.Tensor\.to read it"):
        model[0].weight.to(torch.float32, copy=True)
    with pytest.raises(ShardedParameterError, match=r"'0\.weight' .* torch\.Tensor\.to read it"):
        model[0].weight.to(torch.float64)
    assert_same_run(train(model), train(make_mlp(seed=0)))


@pytest.mark.unit
def test_served_init_checks_its_keywords_before_anything_is_built_and_takes_enabled_by_position():
    import contextlib

    with pytest.raises(ValueError, match=r"remote_device='cpu'.*offload is not implemented"):
        Init(remote_device="cpu")
    with pytest.raises(ValueError, match="module=.*pass it to initialize"):
        Init(module=torch.nn.Linear(2, 2))
    # DeepSpeed's positional order: module, data_parallel_group, mem_efficient_linear, remote_device,
    # pin_memory, config_dict_or_path, config, enabled, dtype
    assert isinstance(Init(None, None, True, None, False, None, None, False, None), contextlib.nullcontext)
    assert isinstance(Init(enabled=False), contextlib.nullcontext)


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_module_built_in_another_thread_during_the_block_stays_whole(world_size):
    import threading

    out = {}
    with Init(config_dict_or_path=CONFIG):
        model = torch.nn.Linear(3, 3)
        worker = threading.Thread(target=lambda: out.setdefault("other", torch.nn.Linear(4, 4)))
        worker.start()
        worker.join()
    assert init_shards.is_partitioned(model.weight)
    assert not init_shards.is_partitioned(out["other"].weight) and not init_shards.is_partitioned(out["other"].bias)
    assert torch.isfinite(out["other"](torch.ones(1, 4))).all()


class _WithIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.index = torch.nn.Parameter(torch.arange(4), requires_grad=False)


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_an_integer_parameter_stays_whole_as_buffers_do(world_size):
    model = built(_WithIndex)
    assert init_shards.is_partitioned(model.lin.weight)
    assert not init_shards.is_partitioned(model.index) and torch.equal(model.index, torch.arange(4))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_ranks_that_build_different_parameters_are_named_on_every_rank(world_size):
    width = 4 + comm.get_rank()
    with pytest.raises(RuntimeError, match=r"rank 1 built other parameters than rank 0"):
        built(lambda: torch.nn.Linear(width, 3))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_pipeline_module_is_refused_by_name_under_the_served_init(world_size):
    from zerodist.pipe import PipelineModule

    with pytest.raises(RuntimeError, match="PipelineModule builds only its own stage"):
        built(lambda: PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2))


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_a_shape_change_on_the_modifier_rank_raises_on_every_rank(world_size):
    model = built(lambda: make_mlp(seed=0))
    weight = model[0].weight
    with pytest.raises(RuntimeError, match=r"'0\.weight' changed shape or dtype inside GatheredParameters on rank 1"):
        with torch.no_grad(), GatheredParameters([weight], modifier_rank=1):
            if comm.get_rank() == 1:
                weight.data = weight.data[:1].clone()


def _tensor_parallel_run(partitioned):
    from tests.tensor_parallel.test_tp_domino_zero3 import MICRO, POST_NORM_SPECS, VOCAB, PostNorm, batch

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": POST_NORM_SPECS}}}
    torch.manual_seed(0)
    if partitioned:
        with Init(config_dict_or_path=config):
            model = PostNorm()
    else:
        model = PostNorm()
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    losses = []
    for step in range(2):
        ids, labels = batch(step, 0)
        loss = F.cross_entropy(engine(input_ids=ids).reshape(-1, VOCAB), labels.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.module_state_dict()
    engine.destroy()
    return losses, state


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_tensor_parallel_over_the_served_init_trains_as_the_eager_build(world_size):
    # the conversion slices the full weights: the shards are made whole first, not the placeholders sliced
    run = _tensor_parallel_run(True)
    assert all(torch.isfinite(torch.tensor(run[0])))
    assert_same_run(run, _tensor_parallel_run(False))


class _CopiesItsHead(torch.nn.Module):  # as RT-DETRv2 and Grounding DINO do in __init__
    def __init__(self):
        super().__init__()
        import copy

        self.head = torch.nn.Linear(4, 4)
        self.decoder_head = copy.deepcopy(self.head)


@pytest.mark.multiprocess
@distributed_test(world_size=[2])
def test_deepcopy_of_a_built_submodule_is_named_and_enabled_false_builds_it(world_size):
    with pytest.raises(ShardedParameterError, match=r"'Linear\.weight' is a ZeRO-3 sharded parameter"):
        built(_CopiesItsHead)
    model = built(_CopiesItsHead, enabled=False)
    assert torch.equal(model.head.weight, model.decoder_head.weight)
