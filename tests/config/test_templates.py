"""DeepSpeed config templates as LLaMA-Factory, axolotl and transformers ship them (templates/,
sources in templates/SOURCES.md): each loads once "auto" is filled as the Hugging Face Trainer
fills it, and trains a tiny Llama on 2 ranks to the parameters of one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.hf_models import hf_batch, hf_class, hf_config, hf_loss
from zerodist.config import Config, ConfigError, TrainerValues, resolve_auto

pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "templates"
# Each asks for CPU offload of optimizer state or parameters: with parameters on the CPU that
# changes nothing (one info line, docs/offload.md), so they load and train as the others do.
OFFLOADING = {
    "axolotl_zero2.json": ["offload_optimizer"],
    "llamafactory_ds_z2_offload_config.json": ["offload_optimizer"],
    "llamafactory_ds_z3_offload_config.json": ["offload_optimizer", "offload_param"],
    "llamafactory_ds_z3_fp8_config.json": ["offload_optimizer"],
    "transformers_ds_config_zero2.json": ["offload_optimizer"],
}
ALL = sorted(path.name for path in TEMPLATES.glob("*.json"))
LOADING = ALL
# transformers' template also names a WarmupLR scheduler (its first step runs at warmup_min_lr, 0):
# the one-process reference below has no warm-up, so that template is loaded but not trained here.
TRAINED = [name for name in ALL if name != "transformers_ds_config_zero2.json"]
MICRO, GAS, STEPS, LR, CLIP, HIDDEN = 2, 2, 3, 1e-2, 1.0, 32


def trainer_values(name: str, data_parallel: int = 2) -> TrainerValues:
    # axolotl's zero3_bf16 says bf16 outright; the Trainer must then be asked for bf16 too.
    return TrainerValues(world_size=data_parallel, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
                         max_grad_norm=CLIP, learning_rate=LR, bf16=name == "axolotl_zero3_bf16.json",
                         hidden_size=HIDDEN, num_training_steps=STEPS, warmup_steps=0)


def raw_template(name: str) -> dict:
    return json.loads((TEMPLATES / name).read_text())


def data_parallel_size(name: str) -> int:
    return 2 // raw_template(name).get("tensor_parallel", {}).get("autotp_size", 1)


def test_the_fixture_holds_every_template_named_in_sources():
    sources = (TEMPLATES / "SOURCES.md").read_text()
    assert len(ALL) == 12
    for name in ALL:
        project, _, rest = name.partition("_")
        assert project in ("llamafactory", "axolotl", "transformers") and rest.removesuffix(".json") in sources, name


@pytest.mark.parametrize("name", LOADING)
def test_template_loads_with_auto_filled_as_the_trainer_fills_it(name):
    config = Config.load(TEMPLATES / name, auto=trainer_values(name, data_parallel_size(name)))
    assert config.gradient_clipping == CLIP
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (MICRO, GAS)
    if "train_batch_size" in raw_template(name):  # else derived from the other two at initialize()
        assert config.train_batch_size == data_parallel_size(name) * MICRO * GAS
    assert config.bf16.enabled is (name == "axolotl_zero3_bf16.json") and config.fp16.enabled is False
    zero = config.zero_optimization
    if raw_template(name)["zero_optimization"].get("reduce_bucket_size") == "auto":
        assert zero.reduce_bucket_size == HIDDEN**2  # the Trainer's hidden_size ** 2
    if zero.stage == 3:
        assert zero.stage3_gather_16bit_weights_on_model_save is True  # either spelling
        if raw_template(name)["zero_optimization"].get("stage3_prefetch_bucket_size") == "auto":
            assert zero.stage3_prefetch_bucket_size == int(0.9 * HIDDEN**2)
            assert zero.stage3_param_persistence_threshold == 10 * HIDDEN


@pytest.mark.parametrize("name", sorted(OFFLOADING))
def test_offloading_template_loads_with_deepspeeds_meanings(name):
    zero = Config.load(TEMPLATES / name, auto=trainer_values(name)).zero_optimization
    raw = raw_template(name)["zero_optimization"]
    for key in OFFLOADING[name]:
        section = getattr(zero, key)
        assert section.device == "cpu" and section.pin_memory is raw[key].get("pin_memory", False)
        assert section.nvme_path is None and section.buffer_count == (4 if key == "offload_optimizer" else 5)
    assert zero.sub_group_size == int(raw.get("sub_group_size", 1e9))


def test_optimizer_and_scheduler_auto_filled_from_the_trainer_values():
    raw = raw_template("transformers_ds_config_zero2.json")
    del raw["zero_optimization"]["offload_optimizer"]
    values = TrainerValues(world_size=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                           max_grad_norm=0.5, learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6,
                           weight_decay=0.1, fp16=True, num_training_steps=100, warmup_steps=0)
    config = Config.load(raw, auto=values)
    assert config.optimizer.params == {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    # warmup 0 becomes 1, as transformers keeps it (DeepSpeed >= 0.19.6 refuses 0).
    assert config.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1}
    assert config.fp16.enabled is True and config.bf16.enabled is False and config.gradient_clipping == 0.5


def test_disagreeing_explicit_values_are_one_error_naming_both_values():
    raw = {**raw_template("llamafactory_ds_z2_config.json"), "gradient_clipping": 0.5, "train_batch_size": 16,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError) as caught:
        resolve_auto(raw, trainer_values("x"))
    assert caught.value.problems == (
        "'train_batch_size' is 16 but the Trainer's world_size x per_device_train_batch_size x "
        "gradient_accumulation_steps is 8; make them agree, or set the key to \"auto\"",
        "'gradient_clipping' is 0.5 but the Trainer's max_grad_norm is 1.0; make them agree, or set the key to "
        "\"auto\"",
        "'optimizer.params.lr' is 0.001 but the Trainer's learning_rate is 0.01; make them agree, or set the key to "
        "\"auto\"",
    )


def test_auto_that_nothing_fills_is_named():
    values = TrainerValues(world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           max_grad_norm=1.0, learning_rate=1e-3)  # no model, no step count yet
    with pytest.raises(ConfigError) as caught:
        Config.load({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
                     "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}, auto=values)
    assert caught.value.problems == (
        "'zero_optimization.reduce_bucket_size' is \"auto\", filled from hidden_size ** 2, which is not known here; "
        "give a value",
        "'scheduler.params.total_num_steps' is \"auto\", filled from num_training_steps, which is not known here; "
        "give a value",
    )


def test_template_auto_without_the_trainer_names_what_fills_it():
    with pytest.raises(ConfigError) as caught:
        Config.load(TEMPLATES / "llamafactory_ds_z2_config.json")
    assert caught.value.problems[0] == (
        "'gradient_clipping': \"auto\" is filled by Hugging Face's Trainer (from max_grad_norm), and nothing fills "
        "it here; give a number >= 0, or train with zerodist.integrations.transformers.ZerodistTrainer")


def test_deepspeed_spellings_accelerate_and_templates_send():
    config = Config.load({"steps_per_print": float("inf"), "_comment": "x", "comms_config": {"verbose": False},
                          "monitor_config": {"enabled": True, "tag": "t"},
                          "zero_optimization": {"stage": 3, "max_live_parameters": 7, "prefetch_bucket_size": 9,
                                                "sub_group_size": 4, "round_robin_gradients": True}})
    assert config.steps_per_print is None  # never logs
    assert (config.zero_optimization.stage3_max_live_parameters,
            config.zero_optimization.stage3_prefetch_bucket_size) == (7, 9)
    with pytest.raises(ConfigError, match="'zero_optimization.max_live_parameters' and "
                       "'zero_optimization.stage3_max_live_parameters' are one DeepSpeed setting"):
        Config.load({"zero_optimization": {"max_live_parameters": 7, "stage3_max_live_parameters": 7}})
    with pytest.raises(ConfigError, match=r"unknown key 'comms_confg' \(did you mean 'comms_logger'\?\)"):
        Config.load({"comms_confg": {}})  # a typo of a real key stays an error
    with pytest.raises(ConfigError, match=r"'zero_optimization.sub_group_size': got true; expected an integer >= 0"):
        Config.load({"zero_optimization": {"sub_group_size": True}})


# ---------------------------------------------------------------- 2 ranks against one process

def _train_from_template(name: str, raw: dict, seed: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    import zerodist

    torch.manual_seed(seed)
    model = hf_class("llama")(hf_config("llama"))
    # The optimizer as the transformers docs' templates write it (tensor parallelism replaces the
    # parameters, so the engine builds it); its "auto"s come from the Trainer's values too.
    auto_params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    raw = {**raw, "optimizer": {"type": "AdamW", "params": auto_params}}
    config = Config.load(raw, auto=trainer_values(name, data_parallel_size(name)))
    engine, *_ = zerodist.initialize(model=model, config=config)
    data_rank, data_size = engine.topology.batch_rank, engine.dp_world_size
    losses = []
    for step in range(STEPS):
        ids = hf_batch(step, MICRO * GAS * data_size)
        for micro in range(GAS):
            start = (micro * data_size + data_rank) * MICRO
            loss = hf_loss(engine, ids[start:start + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    state = {key: value.float() for key, value in engine.module_state_dict().items()}
    engine.destroy()
    return state, losses


def _train_reference(seed: int, rows: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = hf_class("llama")(hf_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # TrainerValues' weight_decay
    for step in range(STEPS):
        ids = hf_batch(step, rows)
        loss = sum(hf_loss(model, ids[m * rows // GAS:(m + 1) * rows // GAS]) for m in range(GAS)) / GAS
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("name", TRAINED)
def test_template_trains_on_two_ranks_to_the_one_process_parameters(name):
    # The micro-batches of a step, in the order [micro 0 of every data rank, micro 1 ...], make up
    # the reference's global batch; its per-micro-batch means average to the engine's loss.
    results = run_distributed(_train_from_template, 2, name, raw_template(name), 0, timeout=180)
    expected = _train_reference(0, MICRO * GAS * data_parallel_size(name))
    bf16 = name == "axolotl_zero3_bf16.json"
    for state, losses in results:
        assert all(torch.isfinite(torch.tensor(losses)))
        for key, value in expected.items():
            # bf16 weights round every step; fp32 differs from one process only in summation order.
            tolerance = 5e-2 if bf16 else 1e-5
            torch.testing.assert_close(state[key], value, atol=tolerance, rtol=tolerance, msg=key)
