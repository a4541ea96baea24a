"""ZerodistTrainer: Hugging Face's Trainer driving a zerodist engine, on 2 gloo ranks, against the
plain Trainer (DDP) with the same arguments, and against zerodist's own loop."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.hf_models import VOCAB, hf_class, hf_config

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).resolve().parents[1] / "config" / "templates"
MICRO, GAS, LR, CLIP, SAMPLES = 2, 2, 1e-3, 1.0, 96


def template(stage: int) -> dict[str, Any]:
    return json.loads((TEMPLATES / f"llamafactory_ds_z{stage}_config.json").read_text())


def dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (SAMPLES, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def training_arguments(output_dir: str, steps: int, **overrides: Any) -> Any:
    settings = dict(output_dir=output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
                    max_steps=steps, max_grad_norm=CLIP, learning_rate=LR, logging_steps=1, use_cpu=True, report_to=[],
                    save_strategy="no", seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **overrides})


def make_trainer(kind: str, output_dir: str, steps: int, config: Any = None, **overrides: Any) -> Any:
    import zerodist

    torch.manual_seed(0)
    # "zerodist-init": built on the meta device, each rank's shard materialised by initialize().
    with zerodist.zero.Init() if kind == "zerodist-init" else contextlib.nullcontext():
        model = hf_class("llama")(hf_config("llama"))
    args = training_arguments(output_dir, steps, **overrides)
    if kind == "plain":
        return transformers.Trainer(model=model, args=args, train_dataset=dataset())
    from zerodist.integrations.transformers import ZerodistTrainer

    return ZerodistTrainer(model=model, args=args, train_dataset=dataset(), config=config)


def logged(trainer: Any) -> list[tuple[float, float, float]]:
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def train_and_save(kind: str, stage: int, output_dir: str, steps: int) -> dict[str, Any]:
    import zerodist.comm as comm

    trainer = make_trainer(kind, output_dir, steps, template(stage))
    with comm.trace() as trace:
        trainer.train()
    trainer.save_model(output_dir + "/final")
    wrapped = trainer.model_wrapped
    ddp = [m for m in wrapped.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    big = [r.op for r in trace.records if r.numel > 1000]  # gradients and parameters, not norms or flags
    if kind != "plain":
        trainer.engine.destroy()
    return {"losses": logged(trainer), "wrapped": type(wrapped).__name__, "ddp": len(ddp),
            "big_collectives": {op: big.count(op) for op in set(big)}}


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    return transformers.LlamaForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_on_llamafactory_template_equals_the_plain_trainer(tmp_path, stage):
    steps = 6
    plain = run_distributed(train_and_save, 2, "plain", stage, str(tmp_path / "plain"), steps, timeout=240)[0]
    ours = run_distributed(train_and_save, 2, "zerodist", stage, str(tmp_path / "zd"), steps, timeout=240)
    assert plain["wrapped"] == "DistributedDataParallel"  # the reference is DDP indeed
    for rank in ours:
        assert (rank["wrapped"], rank["ddp"]) == ("Engine", 0)  # never a DDP module
        assert len(rank["losses"]) == steps
        # Loss, gradient norm and learning rate as the Trainer logs them, step by step.
        torch.testing.assert_close(rank["losses"], plain["losses"], atol=1e-6, rtol=1e-6)
    # Stage 2: each micro-step reduce-scatters into shards, each step all-gathers the parameters once;
    # stage 3 adds the gathers of forward and backward. No all-reduce of gradients (DDP's) at all.
    collectives = ours[0]["big_collectives"]
    assert "all_reduce" not in collectives and collectives["reduce_scatter"] % (steps * GAS) == 0
    expected, saved = load_weights(str(tmp_path / "plain" / "final")), load_weights(str(tmp_path / "zd" / "final"))
    assert saved.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(saved[key], expected[key], atol=1e-5, rtol=1e-5, msg=key)


def test_model_built_in_zero_init_trains_as_the_plain_trainers_at_stage_3(tmp_path):
    plain = run_distributed(train_and_save, 2, "plain", 3, str(tmp_path / "plain"), 3, timeout=240)[0]
    ours = run_distributed(train_and_save, 2, "zerodist-init", 3, str(tmp_path / "zd"), 3, timeout=240)[0]
    torch.testing.assert_close(ours["losses"], plain["losses"], atol=1e-6, rtol=1e-6)
    expected, saved = load_weights(str(tmp_path / "plain" / "final")), load_weights(str(tmp_path / "zd" / "final"))
    for key in expected:
        torch.testing.assert_close(saved[key], expected[key], atol=1e-5, rtol=1e-5, msg=key)


def test_stage_0_reduces_gradients_once_per_accumulation_window(tmp_path):
    steps = 3
    ours = run_distributed(train_and_save, 2, "zerodist", 0, str(tmp_path / "zd"), steps, timeout=240)[0]
    assert ours["big_collectives"] == {"all_reduce": steps}  # one bucket, reduced at each boundary only


def resume_run(output_dir: str, stage: int, resume: bool) -> dict[str, Any]:
    trainer = make_trainer("zerodist", output_dir, 20, template(stage), save_strategy="steps", save_steps=10)
    trainer.train(resume_from_checkpoint=str(Path(output_dir) / "checkpoint-10") if resume else None)
    state = {key: value.clone() for key, value in trainer.engine.module_state_dict().items()}
    trainer.engine.destroy()
    return {"losses": logged(trainer), "state": state}


@pytest.mark.parametrize("stage", [3])
def test_resume_from_checkpoint_at_step_10_ends_where_20_steps_end(tmp_path, stage):
    whole = run_distributed(resume_run, 2, str(tmp_path), stage, False, timeout=300)[0]
    assert (tmp_path / "checkpoint-10" / "latest").exists() and (tmp_path / "checkpoint-20").exists()
    resumed = run_distributed(resume_run, 2, str(tmp_path), stage, True, timeout=300)[0]
    # The resumed run carries steps 1-10 in its restored state and logs 11-20; all equal the whole run.
    torch.testing.assert_close(resumed["losses"], whole["losses"], atol=1e-6, rtol=0)
    for key, value in whole["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, atol=1e-6, rtol=0, msg=key)


def make_refused(output_dir: str, config: Any, **overrides: Any) -> str:
    try:
        make_trainer("zerodist", output_dir, 2, config, **overrides).train()
    except ValueError as error:
        return str(error)
    return "no error"


def test_disagreeing_explicit_value_is_one_error_naming_both_values(tmp_path):
    config = {**template(2), "gradient_clipping": 0.5}
    messages = run_distributed(make_refused, 2, str(tmp_path), config, timeout=120)
    for message in messages:  # every rank, the same error
        assert ("'gradient_clipping' is 0.5 but the Trainer's max_grad_norm is 1.0; make them agree, or set the key "
                "to \"auto\"") in message


def test_settings_that_hand_the_model_elsewhere_are_refused(tmp_path):
    message = run_distributed(make_refused, 2, str(tmp_path), template(2), fsdp="full_shard", timeout=120)[0]
    assert "ZerodistTrainer: TrainingArguments(fsdp=" in message


def sft_run(kind: str, output_dir: str) -> list[float]:
    """TRL's SFTTrainer (plain, or through zerodist_trainer_class) on pre-tokenised rows."""
    import datasets
    import tokenizers
    import trl

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                          unk_token="t1")),
        pad_token="t0", eos_token="t0", unk_token="t1")
    torch.manual_seed(0)
    model = hf_class("llama")(hf_config("llama"))
    rows = torch.randint(2, VOCAB, (64, 16), generator=torch.Generator().manual_seed(1)).tolist()
    # bf16=False: SFTConfig turns bf16 on by default, which is autocast under DDP but bf16 weights (with
    # fp32 master weights) under zerodist, as under DeepSpeed: the losses then differ by about 1e-4.
    args = trl.SFTConfig(output_dir=output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
                         max_steps=4, max_grad_norm=CLIP, learning_rate=LR, logging_steps=1, use_cpu=True, report_to=[],
                         save_strategy="no", seed=0, disable_tqdm=True, packing=False, bf16=False)
    trainer_class = trl.SFTTrainer
    kwargs: dict[str, Any] = {}
    if kind == "zerodist":
        from zerodist.integrations.transformers import zerodist_trainer_class

        trainer_class, kwargs = zerodist_trainer_class(trl.SFTTrainer), {"config": template(3)}
    trainer = trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                            processing_class=tokenizer, **kwargs)
    trainer.train()
    if kind == "zerodist":
        assert type(trainer.model_wrapped).__name__ == "Engine"
        trainer.engine.destroy()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_through_the_class_factory_equals_plain_sft(tmp_path):
    pytest.importorskip("trl")
    plain = run_distributed(sft_run, 2, "plain", str(tmp_path / "plain"), timeout=240)[0]
    ours = run_distributed(sft_run, 2, "zerodist", str(tmp_path / "zd"), timeout=240)[0]
    assert len(ours) == 4
    torch.testing.assert_close(ours, plain, atol=1e-6, rtol=1e-6)
