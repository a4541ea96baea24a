"""DeepSpeed's user-facing surface: config keys that change nothing, `initialize()`'s arguments,
`add_config_arguments`, the engine as an nn.Module with DeepSpeed's accessors, `zero.Init`'s
keywords and `deepspeed.comm`'s names. The tutorial script itself is tests/engine/test_deepspeed_tutorial.py."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.nn.functional as F

import zerodist as deepspeed
import zerodist.comm as comm
from zerodist.config import Config, ConfigError
from zerodist.engine.deepspeed_args import resolve_initialize_arguments
from zerodist.models import make_mlp
from tests.engine_helpers import base_config, global_batch, zerodist_log
from tests.harness import distributed_test


# ---------------------------------------------------------------- config keys that change nothing

@pytest.mark.unit
def test_no_op_deepspeed_values_load_with_one_info_line():
    raw = {"prescale_gradients": False, "nebula": {"enabled": False, "persistent_storage_path": "p"},
           "fp16": {"fp16_master_weights_and_grads": False},
           "zero_optimization": {"stage": 2, "cpu_offload": False, "allgather_partitions": True,
                                 "offload_optimizer": {"device": "none"}, "sub_group_size": 1e9}}
    with zerodist_log() as messages:
        config = Config.load(raw)
    assert config.zero_optimization.stage == 2 and config.zero_optimization.offload_optimizer.device == "none"
    assert len(messages) == 1
    for named in ("prescale_gradients=false", "nebula=", "fp16.fp16_master_weights_and_grads=false",
                  "zero_optimization.cpu_offload=false", "zero_optimization.allgather_partitions=true"):
        assert named in messages[0], named
    with zerodist_log() as messages:
        Config.load({"zero_optimization": {"stage": 1}})
    assert messages == []  # nothing to name, no line


@pytest.mark.unit
@pytest.mark.parametrize(("raw", "fragment"), [
    ({"zero_optimization": {"cpu_offload": True}}, "'zero_optimization.cpu_offload' is a DeepSpeed setting that "
     "zerodist does not implement yet; remove it (accepted, as changing nothing here: false)"),
    ({"zero_optimization": {"allgather_partitions": 1}}, "'zero_optimization.allgather_partitions' is a DeepSpeed"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "'zero_optimization.offload_param' is set at "
     "stage 0; parameters are offloaded at stage 3 only"),
    ({"prescale_gradients": True}, "'prescale_gradients' is a DeepSpeed setting"),
    ({"amp": {"enabled": True}}, "accepted, as changing nothing here: a section with \"enabled\": false"),
    ({"bf16": {"check_grad_overflow": True}}, "'bf16.check_grad_overflow' is a DeepSpeed setting"),
    ({"zero_optimization": {"cpu_ofload": False}}, "unknown key 'zero_optimization.cpu_ofload' (did you mean "
     "'cpu_offload'?)"),
    ({"presacle_gradients": False}, "unknown key 'presacle_gradients' (did you mean 'prescale_gradients'?)"),
])
def test_values_asking_for_more_and_typos_stay_errors(raw, fragment):
    with pytest.raises(ConfigError) as caught:
        Config.load(raw)
    assert fragment in str(caught.value)


# ---------------------------------------------------------------- arguments and initialize()

@pytest.mark.unit
def test_add_config_arguments_has_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False, None)
    assert parser.parse_args([]).deepspeed is False


def _resolve(args=None, model=torch.nn.Linear(1, 1), config=None, config_params=None, mpu=None, mesh_param=None):
    return resolve_initialize_arguments(args=args, model=model, config=config, config_params=config_params, mpu=mpu,
                                        mesh_param=mesh_param, distributed_port=29500, dist_init_required=None)


@pytest.mark.unit
def test_initialize_takes_the_config_as_deepspeed_does():
    args = argparse.Namespace(deepspeed_config="from_args.json")
    assert _resolve(args) == "from_args.json"
    assert _resolve(argparse.Namespace(deepspeed_config=None, deepscale_config="old.json")) == "old.json"
    assert _resolve(config_params={"a": 1}) == {"a": 1}
    assert _resolve(config={"b": 1}, config_params={"a": 1}) == {"b": 1}  # DeepSpeed prefers config
    assert _resolve() is None  # zerodist's defaults
    with pytest.raises(ValueError, match="given twice, by --deepspeed_config"):
        _resolve(args, config={"b": 1})
    with pytest.raises(ValueError, match="both --deepscale_config and --deepspeed_config"):
        _resolve(argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json"))


@pytest.mark.unit
def test_initialize_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="takes no model-parallel unit; remove mpu"):
        _resolve(mpu=object())
    # DeepSpeed's sequence-parallel mesh is taken (tests/integrations/test_manual_sequence.py) when it fits the world
    with pytest.raises(ValueError, match="data 2 x sequence 1 = 2 ranks, but the world has 1"):
        _resolve(mesh_param=(2, 1))
    with pytest.raises(ValueError, match=r"\(data_parallel_size, sequence_parallel_size\), two positive ints"):
        _resolve(mesh_param="2x1")
    assert _resolve(config={"train_batch_size": 1}, mesh_param=(1, 1))["zerodist"]["sequence_parallel"] == {
        "method": "manual"}
    with pytest.raises(TypeError, match="first positional argument is `args`"):
        _resolve(args=torch.nn.Linear(1, 1), model=None)
    with pytest.raises(TypeError, match="requires a model"):
        _resolve(model=None)
    with pytest.raises(ValueError, match="remove mpu"):
        deepspeed.initialize(model=make_mlp(), mpu=object())


# ---------------------------------------------------------------- the engine as an nn.Module

@distributed_test(world_size=1)
def test_engine_is_the_models_nn_module_wrapper():
    model = make_mlp()
    attributes_before = set(vars(model))
    engine, _, _, _ = deepspeed.initialize(model=model, config=base_config(0, gradient_accumulation_steps=2))
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert set(vars(model)) == attributes_before  # nothing set on the user's module
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert list(engine.state_dict()) == [f"module.{k}" for k in model.state_dict()]
    assert all(a is b for a, b in zip(engine.parameters(), model.parameters()))
    with pytest.raises(AttributeError, match="neither has the model it wraps"):
        engine.no_such_attribute
    calls = []
    engine.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    x, y = global_batch(0, 4)
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    assert (engine.gradient_accumulation_steps(), engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (2, 8, 4)
    applied = []
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True]  # only the accumulation boundary steps the optimizer
    assert calls == [torch.Size([4, 8])] * 2
    assert (engine.global_steps, engine.global_samples) == (1, 8)
    assert (engine.zero_optimization(), engine.zero_optimization_stage(), engine.optimizer_name()) == (False, 0, "AdamW")


@distributed_test(world_size=1)
def test_attribute_fall_through_reads_the_models_own_attributes():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 8)
            self.temperature = 0.5

        def forward(self, x):
            return self.fc1(x) * self.temperature

    net = Net()
    engine, _, _, _ = deepspeed.initialize(model=net, config=base_config(1))
    assert engine.fc1 is net.fc1 and engine.temperature == 0.5
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.device) == (0, 0, 1, torch.device("cpu"))
    assert (engine.dp_world_size, engine.mp_world_size) == (1, 1)


@distributed_test(world_size=2)
def test_state_dict_at_stage_3_needs_the_parameters_gathered():
    from zerodist.zero import GatheredParameters, ShardedParameterError

    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=base_config(3, zero_optimization={
        "stage3_param_persistence_threshold": 0}))
    with pytest.raises(ShardedParameterError, match="module_state_dict"):
        engine.state_dict()
    with GatheredParameters(list(engine.parameters())):
        gathered = {k: v.clone() for k, v in engine.state_dict().items()}
    full = engine.module_state_dict()
    assert list(gathered) == [f"module.{k}" for k in full]
    assert all(torch.equal(gathered[f"module.{k}"], v) for k, v in full.items())


@distributed_test(world_size=2)
def test_save_16bit_model_writes_the_plain_models_keys_on_rank_0():
    import tempfile

    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=base_config(3, bf16={"enabled": True}))
    directory = [tempfile.mkdtemp(prefix="zerodist-16bit-") if comm.get_rank() == 0 else None]
    comm.broadcast_object_list(directory, src=0)
    assert engine.save_16bit_model(directory[0]) is True
    comm.barrier()
    path = os.path.join(directory[0], "pytorch_model.bin")
    saved = torch.load(path)
    expected = engine.module_state_dict()
    assert list(saved) == list(expected)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, expected[k]) for k, v in saved.items())
    comm.barrier()
    if comm.get_rank() == 0:
        os.remove(path)
        os.rmdir(directory[0])


# ---------------------------------------------------------------- zero.Init's keywords

@pytest.mark.unit
def test_zero_init_accepts_keywords_that_ask_for_nothing_new():
    with deepspeed.zero.Init(enabled=False):
        eager = torch.nn.Linear(2, 2)
    assert not eager.weight.is_meta
    with deepspeed.zero.Init(remote_device="none", mem_efficient_linear=False, pin_memory=False,
                             config_dict_or_path={"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
                             dtype=torch.bfloat16):
        meta = torch.nn.Linear(2, 2)
    assert meta.weight.is_meta


@pytest.mark.unit
@pytest.mark.parametrize(("keywords", "fragment"), [
    ({"remote_device": "cpu"}, "parameter offload is not implemented"),
    ({"pin_memory": True}, "pinned memory is for CPU offload"),
    ({"module": torch.nn.Linear(1, 1)}, "pass it to initialize(model=...)"),
    ({"mpu": object()}, "takes no model-parallel unit"),
    ({"dtype": torch.float16, "config_dict_or_path": {"bf16": {"enabled": True}}}, "its config trains in torch.bfloat16"),
    ({"config": {}, "config_dict_or_path": {}}, "give one of them"),
    ({"zero_quantized_weights": True}, "quantized weights are not implemented"),
    ({"config_dict_or_path": {"zero_optimization": {"stage": 4}}}, "'zero_optimization.stage': got 4"),
])
def test_zero_init_refuses_keywords_asking_for_more(keywords, fragment):
    with pytest.raises(ValueError) as caught:
        deepspeed.zero.Init(**keywords)
    assert fragment in str(caught.value)


@pytest.mark.unit
def test_zero_init_rejects_names_deepspeed_does_not_have():
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        deepspeed.zero.Init(remote_devices=None)


# ---------------------------------------------------------------- deepspeed.comm's names

@distributed_test(world_size=2)
def test_deepspeed_comm_names_and_signatures():
    from zerodist import comm as dist

    info = deepspeed.init_distributed(dist_backend="gloo", distributed_port=29500, verbose=False)
    assert info.world_size == 2 and dist.is_initialized() and dist.is_available()
    with pytest.raises(comm.DistributedInitError, match="init_distributed\\(rank=5\\)"):
        deepspeed.init_distributed(rank=5)
    rank = dist.get_rank()
    assert dist.get_world_group() is torch.distributed.group.WORLD
    assert dist.get_global_rank(dist.get_world_group(), 1) == 1 and dist.get_global_rank() == 0
    assert dist.get_all_ranks_from_group() == [0, 1] and dist.get_local_rank() == rank
    reversed_group = dist.new_group([1, 0])
    assert dist.get_all_ranks_from_group(reversed_group) == [0, 1]
    gathered = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(gathered, torch.full((2,), float(rank + 1)))  # DeepSpeed's (torch's) list form
    assert [t.tolist() for t in gathered] == [[1.0, 1.0], [2.0, 2.0]]
    flat = torch.zeros(4)
    dist.all_gather(flat, torch.full((2,), float(rank)))  # zerodist's flat form still works
    assert flat.tolist() == [0.0, 0.0, 1.0, 1.0]
    handle = dist.all_gather(gathered, torch.full((2,), 5.0 + rank), async_op=True)
    handle.wait()
    assert [t.tolist() for t in gathered] == [[5.0, 5.0], [6.0, 6.0]]
    output = torch.zeros(2)
    dist.reduce_scatter(output, [torch.full((2,), 1.0 + rank), torch.full((2,), 10.0 + rank)])
    assert output.tolist() == ([3.0, 3.0] if rank == 0 else [21.0, 21.0])
    dist.reduce_scatter_tensor(output, torch.arange(4.0))
    assert output.tolist() == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
    tensor = torch.tensor([float(rank)])
    dist.inference_all_reduce(tensor)
    assert tensor.item() == 1.0
    with pytest.raises(ValueError, match="one per rank of the group"):
        dist.all_gather([torch.zeros(2)], torch.zeros(2))


@distributed_test(world_size=1)
def test_backward_and_step_take_deepspeeds_keywords():
    """`scale_wrt_gas=False` on a loss the script divided itself trains exactly as the default does;
    `lr_kwargs` reach the scheduler; the checkpoint keywords zerodist cannot honour are refused."""
    states = []
    for scale_wrt_gas in (True, False):
        torch.manual_seed(0)
        config = base_config(2, gradient_accumulation_steps=2, scheduler={
            "type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}})
        engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config)
        for micro in range(4):
            x, y = global_batch(micro, 4)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss if scale_wrt_gas else loss / 2, retain_graph=True, scale_wrt_gas=scale_wrt_gas)
            engine.step(lr_kwargs={"last_batch_iteration": 5} if micro == 3 else None)
        states.append(engine.module_state_dict())
        assert engine.lr_scheduler.last_batch_iteration == 5
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    with pytest.raises(ValueError, match="exclude_frozen_parameters=True"):
        engine.save_checkpoint("unused", exclude_frozen_parameters=True)
    with pytest.raises(ValueError, match="strictly"):
        engine.load_checkpoint("unused", None, False)


@pytest.mark.multiprocess
def test_distributed_port_and_dist_init_required_keep_deepspeeds_meanings():
    """In a fresh process (no process group yet): dist_init_required=False is an error naming the fix,
    and distributed_port becomes rank 0's port only when the launcher gave none."""
    import sys

    from tests.processes import run_group

    code = (
        "import os, torch, zerodist as deepspeed\n"
        "try:\n"
        "    deepspeed.initialize(model=torch.nn.Linear(2, 2), dist_init_required=False)\n"
        "except RuntimeError as error:\n"
        "    print('REFUSED', error)\n"
        "deepspeed.comm.use_default_port(29611)\n"
        "print('PORT', os.environ.get('MASTER_PORT'))\n"
        "for bad in (0, 70000, True):\n"
        "    try:\n"
        "        deepspeed.comm.use_default_port(bad)\n"
        "    except deepspeed.comm.DistributedInitError as error:\n"
        "        print('BAD', bad)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    out = run_group([sys.executable, "-c", code], timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED initialize(dist_init_required=False) but no process group exists" in out.stdout
    assert "PORT 29611" in out.stdout
    assert [line for line in out.stdout.splitlines() if line.startswith("BAD")] == ["BAD 0", "BAD 70000", "BAD True"]


def _load_without_optimizer(directory: str, stage: int) -> tuple[bool, list[str]]:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    torch.manual_seed(0)
    trained, *_ = deepspeed.initialize(model=make_mlp(), config={**config, **{"optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}}})
    trained.backward(trained(torch.randn(2, trained.module[0].in_features)).sum())
    trained.step()
    trained.save_checkpoint(directory)
    saved = trained.module_state_dict()
    trained.destroy()
    torch.manual_seed(1)
    fresh, *_ = deepspeed.initialize(model=make_mlp(), config=config)
    with zerodist_log() as log:  # HF's deepspeed_load_checkpoint asks for the optimizer's state
        path, _ = fresh.load_checkpoint(directory, load_optimizer_states=True, load_lr_scheduler_states=True)
    state = fresh.module_state_dict()
    fresh.destroy()
    return path is not None and all(torch.equal(state[k], v) for k, v in saved.items()), log


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_an_optimizer_loads_a_checkpoint_without_its_optimizer_state(tmp_path, stage):
    """DeepSpeed skips the optimizer state when its engine has none (it refused with 'AdamW's state;
    this engine steps with NoOptimizer')."""
    from tests.harness import run_distributed

    loaded, log = run_distributed(_load_without_optimizer, 1, str(tmp_path), stage, timeout=120)[0]
    assert loaded and any("no optimizer" in line and "AdamW" in line for line in log)
