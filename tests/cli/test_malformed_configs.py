"""`zerodist train` with a malformed config or a flag combination the engine cannot run ends before
spawning any rank: exit code 2 and one message naming the key or the flag (issue 37: the fault
probe's 31 malformed configs, in our own equivalents). The launcher and the in-place trainer are
replaced by functions that fail the test, so a case that slipped through could not spawn."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.unit

AUTO = "auto"
CASES: list[tuple[str, object, list[str], str]] = [
    # wrong types in the optimizer's and scheduler's params (against the class's signature)
    ("lr-bool", {"optimizer": {"type": "AdamW", "params": {"lr": True}}}, [], "optimizer.params.lr: true is not a number"),
    ("betas-one", {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, [],
     "optimizer.params.betas: [0.9] is not a list of 2 numbers"),
    ("eps-string", {"optimizer": {"type": "AdamW", "params": {"eps": "1e-8"}}}, [], "optimizer.params.eps"),
    ("amsgrad-int", {"optimizer": {"type": "Adam", "params": {"amsgrad": 1}}}, [], "optimizer.params.amsgrad"),
    ("momentum-list", {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": [0.9]}}}, [],
     "optimizer.params.momentum"),
    ("weight-decay-null", {"optimizer": {"type": "AdamW", "params": {"weight_decay": None}}}, [],
     "optimizer.params.weight_decay"),
    ("warmup-steps-text", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}}, [],
     "scheduler.params.warmup_num_steps: \"ten\" is not an integer"),
    ("cos-ratio-text", {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 4,
                                                                           "cos_min_ratio": "0.1"}}}, [],
     "scheduler.params.cos_min_ratio"),
    ("step-size-bool", {"scheduler": {"type": "StepLR", "params": {"step_size": True}}}, [],
     "scheduler.params.step_size"),
    # wrong types and negative sizes in the typed sections
    ("stage-text", {"zero_optimization": {"stage": "2"}}, [], "zero_optimization.stage"),
    ("stage-5", {"zero_optimization": {"stage": 5}}, [], "zero_optimization.stage"),
    ("bf16-text", {"bf16": {"enabled": "true"}}, [], "bf16.enabled"),
    ("clipping-text", {"gradient_clipping": "1.0"}, [], "gradient_clipping"),
    ("micro-negative", {"train_micro_batch_size_per_gpu": -1}, [], "train_micro_batch_size_per_gpu"),
    ("accumulation-zero", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0}, [],
     "gradient_accumulation_steps"),
    ("bucket-negative", {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}, [], "reduce_bucket_size"),
    ("sub-group-negative", {"zero_optimization": {"stage": 2, "sub_group_size": -1}}, [], "sub_group_size"),
    ("keep-last-negative", {"checkpoint": {"keep_last": -1}}, [], "keep_last"),
    ("lr-negative", {"optimizer": {"type": "AdamW", "params": {"lr": -1.0}}}, [], "lr"),
    # conflicting batch sizes, precisions
    ("batch-conflict", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     [], "train_batch_size"),
    ("fp16-and-bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], "bf16"),
    # unknown keys and names
    ("unknown-section", {"zero_optimisation": {"stage": 2}}, [], "zero_optimisation"),
    ("unknown-nested", {"zero_optimization": {"stagee": 2}}, [], "stagee"),
    ("unknown-param", {"optimizer": {"type": "AdamW", "params": {"lrr": 0.1}}}, [], "lrr"),
    ("unknown-optimizer", {"optimizer": {"type": "Adamm", "params": {}}}, [], "optimizer.type"),
    ("unknown-scheduler", {"scheduler": {"type": "WarmupLRR", "params": {}}}, [], "scheduler.type"),
    ("section-not-object", {"optimizer": 3}, [], "optimizer"),
    # invalid JSON, misplaced "auto"
    ("invalid-json", "{\"train_micro_batch_size_per_gpu\": 4,", [], "JSON"),
    ("auto-lr", {"optimizer": {"type": "AdamW", "params": {"lr": AUTO}}}, [], "optimizer.params"),
    ("auto-stage", {"zero_optimization": {"stage": AUTO}}, [], "zero_optimization.stage"),
    # incompatible axes and flags
    ("pp-sp-not-dividing", None, ["--nproc", "2", "--pp", "2", "--sp", "2"], "--pp"),
    ("pp-sp-file-not-dividing", {"sequence_parallel_size": 2}, ["--nproc", "2", "--pp", "2"], "--sp"),
    ("domino-without-tp", None, ["--nproc", "4", "--pp", "2", "--domino", "2"], "--domino"),
    ("pp-tp-not-dividing", None, ["--nproc", "4", "--pp", "2", "--tp", "4"], "--pp"),
    ("tp-not-dividing", None, ["--tp", "3"], "--tp"),
    ("tp-times-sp", None, ["--tp", "2", "--sp", "2"], "--sp"),
    ("moe-not-dividing", None, ["--moe", "3"], "--moe"),
    ("pp-more-stages-than-blocks", None, ["--model", "tiny", "--pp", "2", "--schedule", "interleaved"],
     "4 pipeline stages for the 2 blocks"),
    ("pp-moe-not-dividing", None, ["--nproc", "4", "--pp", "2", "--moe", "3"], "(nproc / pipe 2)"),
    # keys whose validity depends on the layout (zerodist/cli/layout_checks.py): they passed these checks and
    # then failed on every rank with a traceback
    ("mics-not-dividing", {"zero_optimization": {"stage": 3, "mics_shard_size": 3}}, [],
     "'zero_optimization.mics_shard_size' (3) must divide the data-parallel degree (2)"),
    ("mics-with-moe", {"zero_optimization": {"stage": 3, "mics_shard_size": 1}}, ["--nproc", "4", "--moe", "4"],
     "'zero_optimization.mics_shard_size' (1) cannot be combined with expert parallelism"),
    ("hpz-with-pp", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
     ["--nproc", "4", "--pp", "2"], "'zero_optimization.zero_hpz_partition_size' (2) cannot be combined with pipeline"),
    ("hsdp-degrees-not-the-group", {"zero_optimization": {"stage": 3},
                                    "zerodist": {"hsdp": {"shard_degree": 2, "replicate_degree": 3}}},
     ["--nproc", "4"], "'zerodist.hsdp': shard_degree (2) x replicate_degree (3) must be the 4 ranks"),
    ("hpz-not-dividing", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, [],
     "'zero_optimization.zero_hpz_partition_size' (3) must divide the 2 ranks"),
    ("simulated-nodes-not-dividing", {"zerodist": {"simulated_nodes": 3}}, [],
     "'zerodist.simulated_nodes' (3) does not divide the world of 2 ranks"),
    ("layout-invariant-with-qwz", {"zerodist": {"deterministic": "layout_invariant"},
                                   "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, [],
     "zero_optimization.zero_quantized_weights change how gradients are reduced"),
    ("layout-invariant-with-comm-dtype", {"zerodist": {"deterministic": "layout_invariant"},
                                          "communication_data_type": "bf16"}, [], "communication_data_type change"),
    ("layout-invariant-three-ranks", {"zerodist": {"deterministic": "layout_invariant"}}, ["--nproc", "3"],
     "the data-parallel degree 3 is not a power of two"),
    # wrong types in the sections added since the probe
    ("deterministic-bool", {"zerodist": {"deterministic": True}}, [], "'zerodist.deterministic': got true"),
    ("mics-text", {"zero_optimization": {"stage": 3, "mics_shard_size": "2"}}, [], "zero_optimization.mics_shard_size"),
    ("hpz-zero", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, [],
     "zero_optimization.zero_hpz_partition_size"),
    ("qwz-int", {"zero_optimization": {"stage": 3, "zero_quantized_weights": 1}}, [],
     "zero_optimization.zero_quantized_weights"),
    ("comm-dtype-fp8", {"communication_data_type": "fp8"}, [], "communication_data_type"),
    ("max-active-stages-text", {"zerodist": {"pipeline": {"max_active_stages": "2"}}}, [],
     "zerodist.pipeline.max_active_stages"),
    ("max-active-stages-zero", {"zerodist": {"pipeline": {"max_active_stages": 0}}}, [],
     "zerodist.pipeline.max_active_stages"),
    ("timeline-not-object", {"zerodist": {"timeline": True}}, [], "'zerodist.timeline': got true"),
    ("timeline-steps-text", {"zerodist": {"timeline": {"enabled": True, "num_steps": "1"}}}, [],
     "zerodist.timeline.num_steps"),
    ("wandb-enabled-text", {"wandb": {"enabled": "true"}}, [], "'wandb.enabled'"),
    ("comet-interval-zero", {"comet": {"samples_log_interval": 0}}, [], "comet.samples_log_interval"),
    # DeepSpeed's aio section, ignored here but type-checked as DeepSpeed's schema has it (it passed before)
    ("aio-block-size-text", {"aio": {"block_size": "1M"}}, [], "'aio.block_size': got \"1M\"; expected an integer >= 1"),
    ("aio-queue-depth-zero", {"aio": {"queue_depth": 0}}, [], "'aio.queue_depth': got 0"),
    ("aio-thread-count-negative", {"aio": {"thread_count": -1}}, [], "'aio.thread_count': got -1"),
    ("aio-single-submit-int", {"aio": {"single_submit": 1}}, [], "'aio.single_submit': got 1; expected true or false"),
    ("aio-overlap-events-text", {"aio": {"overlap_events": "yes"}}, [], "'aio.overlap_events'"),
    ("aio-unknown-key", {"aio": {"threads": 2}}, [], "unknown key 'aio.threads'"),
]


@pytest.mark.parametrize("name,config,flags,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_or_flags_end_before_spawn_naming_the_key(tmp_path, monkeypatch, capsys, name, config, flags,
                                                                   expected):
    from zerodist.cli import run as run_module
    from zerodist.cli import train as train_module
    from zerodist.cli.main import main

    def spawned(*_args, **_kwargs):
        raise AssertionError(f"{name}: passed the pre-spawn checks")

    monkeypatch.setattr(run_module, "launch", spawned)
    monkeypatch.setattr(train_module, "train_in_place", spawned)
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    argv = ["train", "--out", str(tmp_path / "out"), "--steps", "4"]
    if config is not None:
        path = tmp_path / "config.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        argv += ["--config", str(path)]
    if "--nproc" not in flags:
        argv += ["--nproc", "2"]
    code = main(argv + flags)
    err = capsys.readouterr().err
    assert code == 2, (name, err)
    assert expected in err, (name, err)
    assert "Traceback" not in err and err.startswith("zerodist train: "), err


# Combinations that once ended here and now pass the pre-spawn checks (they train: tests/pipe/test_pipeline_cli.py).
NOW_PASSING = [
    ("pp-with-tp", None, ["--nproc", "4", "--pp", "2", "--tp", "2"]),
    ("pp-with-autotp", {"tensor_parallel": {"autotp_size": 2}}, ["--nproc", "4", "--pp", "2"]),
    ("pp-with-save-and-resume", None, ["--pp", "2", "--save-interval", "2", "--resume"]),
    ("pp-with-moe", None, ["--nproc", "4", "--pp", "2", "--moe", "2"]),
    # the layout checks let through what the engine runs
    ("mics-dividing", {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, ["--nproc", "4"]),
    ("hpz-dividing", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, ["--nproc", "4"]),
    ("mics-with-tp", {"zero_optimization": {"stage": 3, "mics_shard_size": 1}}, ["--nproc", "4", "--tp", "2"]),
    ("hpz-with-tp", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, ["--nproc", "8", "--tp", "2"]),
    ("layout-invariant", {"zerodist": {"deterministic": "layout_invariant"}}, ["--nproc", "4", "--stage", "3"]),
]


@pytest.mark.parametrize("name,config,flags", NOW_PASSING, ids=[c[0] for c in NOW_PASSING])
def test_composed_pipeline_flags_pass_the_pre_spawn_checks(tmp_path, monkeypatch, capsys, name, config, flags):
    from zerodist.cli import run as run_module
    from zerodist.cli.main import main

    launched: list[object] = []
    monkeypatch.setattr(run_module, "launch", lambda *args, **kwargs: launched.append(args) or 0)
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    argv = ["train", "--out", str(tmp_path / "out"), "--steps", "4", "--model", "tiny"]
    if config is not None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        argv += ["--config", str(path)]
    if "--nproc" not in flags:
        argv += ["--nproc", "2"]
    code = main(argv + flags)
    assert code == 0 and launched, (name, capsys.readouterr().err)


def test_there_are_at_least_31_cases():
    assert len(CASES) >= 31
