"""Layer 2: the typed config. Pure tests: no processes, no torch."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from zerodist.config import (
    BatchSizes,
    Config,
    ConfigError,
    render_defaults_markdown,
    resolve_batch_sizes,
    show_config,
)
from zerodist.config.deepspeed_keys import NOT_IMPLEMENTED

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
AUTO_CANNOT = '"auto" cannot be resolved by zerodist; give'
AUTO_TRAINER = '"auto" is filled by Hugging Face\'s Trainer'

# (id, config, fragment the error must contain)
BAD_CONFIGS = [
    (
        "unknown-top-level",
        {"train_batchsize": 8},
        "unknown key 'train_batchsize' (did you mean 'train_batch_size'?)",
    ),
    (
        "unknown-top-level-lists-keys",
        {"xyz": 1},
        "unknown key 'xyz'; valid keys: train_batch_size,",
    ),
    (
        "unknown-nested",
        {"zero_optimization": {"stge": 2}},
        "unknown key 'zero_optimization.stge' (did you mean 'stage'?)",
    ),
    (
        "unknown-nested-lists-keys",
        {"zerodist": {"debug": {"qqq": True}}},
        "valid keys in 'zerodist.debug': collective_guard, nan_check",
    ),
    (
        "deepspeed-top-level",
        {"activation_checkpointing": {"partition_activations": True}},
        "'activation_checkpointing' is a DeepSpeed setting that zerodist does not implement yet; remove it",
    ),
    (
        "deepspeed-top-level-flag",
        {"sparse_gradients": True},
        "'sparse_gradients' is a DeepSpeed setting",
    ),
    (
        "deepspeed-zero",
        {"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}},
        "'zero_optimization.zeropp_loco_param' is a DeepSpeed setting that zerodist does not implement yet; "
        "remove it",
    ),
    (
        "deepspeed-zero-old-name",
        {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
        "'zero_optimization.stage3_gather_fp16_weights_on_model_save' is a DeepSpeed setting",
    ),
    ("deepspeed-fp16", {"fp16": {"auto_cast": True}}, "'fp16.auto_cast' is a DeepSpeed setting"),
    (
        "deepspeed-bf16",
        {"bf16": {"immediate_grad_update": True}},
        "'bf16.immediate_grad_update' is a DeepSpeed setting",
    ),
    (
        "renamed-bfloat16",
        {"bfloat16": {"enabled": True}},
        "'bfloat16' is DeepSpeed's old name for 'bf16'; rename it",
    ),
    (
        "string-for-bool",
        {"fp16": {"enabled": "true"}},
        "'fp16.enabled': got \"true\"; expected true or false",
    ),
    ("int-for-bool", {"bf16": {"enabled": 1}}, "'bf16.enabled': got 1; expected true or false"),
    (
        "string-for-int",
        {"zero_optimization": {"stage": "2"}},
        "'zero_optimization.stage': got \"2\"; expected an integer from 0 to 3",
    ),
    (
        "stage-4",
        {"zero_optimization": {"stage": 4}},
        "'zero_optimization.stage': got 4; expected an integer from 0 to 3",
    ),
    ("stage-negative", {"zero_optimization": {"stage": -1}}, "'zero_optimization.stage': got -1"),
    (
        "negative-clipping",
        {"gradient_clipping": -1.0},
        "'gradient_clipping': got -1.0; expected a number >= 0",
    ),
    ("nan-clipping", {"gradient_clipping": float("nan")}, "'gradient_clipping': got NaN"),
    (
        "zero-batch",
        {"train_batch_size": 0},
        "'train_batch_size': got 0; expected an integer >= 1, \"auto\" or null",
    ),
    (
        "float-micro-batch",
        {"train_micro_batch_size_per_gpu": 2.5},
        "'train_micro_batch_size_per_gpu': got 2.5",
    ),
    (
        "fractional-bucket",
        {"zero_optimization": {"reduce_bucket_size": 1.5}},
        "'zero_optimization.reduce_bucket_size': got 1.5; expected an integer >= 0 or \"auto\"",
    ),
    (
        "negative-bucket",
        {"zero_optimization": {"allgather_bucket_size": -5e8}},
        "'zero_optimization.allgather_bucket_size': got -500000000",
    ),
    ("section-not-object", {"fp16": True}, "'fp16': got true; expected an object"),
    (
        "fp16-and-bf16",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "'fp16.enabled' and 'bf16.enabled' are both true; choose one precision",
    ),
    (
        "auto-clipping",
        {"gradient_clipping": "auto"},
        f"'gradient_clipping': {AUTO_TRAINER} (from max_grad_norm), and nothing fills it here; give a number",
    ),
    ("auto-bool", {"fp16": {"enabled": "auto"}}, f"'fp16.enabled': {AUTO_TRAINER} (from fp16)"),
    (
        "auto-stage",
        {"zero_optimization": {"stage": "auto"}},
        f"'zero_optimization.stage': {AUTO_CANNOT} an integer",
    ),
    (
        "auto-optimizer-param",
        {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
        f"'optimizer.params.lr': {AUTO_TRAINER} (from learning_rate)",
    ),
    (
        "optimizer-without-type",
        {"optimizer": {"params": {"lr": 1e-3}}},
        "missing required key 'optimizer.type'",
    ),
    (
        "optimizer-params-list",
        {"optimizer": {"type": "AdamW", "params": [0.001]}},
        "'optimizer.params': got [0.001]; expected an object",
    ),
    (
        "scheduler-type-number",
        {"scheduler": {"type": 3}},
        "'scheduler.type': got 3; expected a non-empty string",
    ),
    (
        "tag-validation",
        {"checkpoint": {"tag_validation": "warn"}},
        'expected one of "Ignore", "Warn", "Fail"',
    ),
    (
        "negative-save-interval",
        {"checkpoint": {"save_interval": -1}},
        "'checkpoint.save_interval': got -1; expected an integer >= 0",
    ),
    (
        "prof-ops-item",
        {"comms_logger": {"prof_ops": ["all_reduce", 3]}},
        "'comms_logger.prof_ops[1]': got 3; expected a string",
    ),
    (
        "zero-timeout",
        {"zerodist": {"timeout": 0}},
        "'zerodist.timeout': got 0; expected a number > 0 or null",
    ),
    (
        "steps-per-print",
        {"steps_per_print": 0},
        "'steps_per_print': got 0; expected an integer >= 1",
    ),
]


@pytest.mark.parametrize(
    ("config", "fragment"),
    [case[1:] for case in BAD_CONFIGS],
    ids=[case[0] for case in BAD_CONFIGS],
)
def test_bad_config_is_rejected_with_a_clear_line(config, fragment):
    with pytest.raises(ConfigError) as caught:
        Config.load(config)
    assert fragment in str(caught.value)
    assert len(caught.value.problems) == 1, caught.value.problems
    assert "pydantic" not in str(caught.value) and "Input should" not in str(caught.value)


def test_every_problem_is_reported_together():
    config = {
        "train_batchsize": 8,
        "amp": {"enabled": True},
        "gradient_clipping": "auto",
        "fp16": {"enabled": True, "loss_scale": -1},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 4, "zeropp_loco_param": {"err_beta": 0.8}},
    }
    with pytest.raises(ConfigError) as caught:
        Config.load(config)
    problems = caught.value.problems
    assert len(problems) == 7, problems
    message = str(caught.value)
    assert message.startswith("invalid zerodist config: 7 problems\n  - ")
    for fragment in (
        "unknown key 'train_batchsize' (did you mean 'train_batch_size'?)",
        "'amp' is a DeepSpeed setting",
        f"'gradient_clipping': {AUTO_TRAINER}",
        "'fp16.loss_scale': got -1",
        "'zero_optimization.stage': got 4",
        "'zero_optimization.zeropp_loco_param' is a DeepSpeed setting",
        "'fp16.enabled' and 'bf16.enabled' are both true",
    ):
        assert fragment in message


@pytest.mark.parametrize(
    ("section", "key"),
    [(section, key) for section, keys in NOT_IMPLEMENTED.items() for key in keys],
)
def test_every_deepspeed_key_not_implemented_is_an_error(section, key):
    # A string is no key's no-op value (NO_OP_VALUES), so every key is refused with it.
    config = {key: "on"} if not section else {section: {key: "on"}}
    path = f"{section}.{key}" if section else key
    with pytest.raises(
        ConfigError, match=f"'{path}' is a DeepSpeed setting that zerodist does not implement yet"
    ):
        Config.load(config)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- loading from files -------------------------------------------------------------------


def test_load_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {"train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        )
    )
    for source in (path, str(path)):
        config = Config.load(source)
        assert (
            config.train_batch_size == 16
            and config.fp16.enabled
            and config.zero_optimization.stage == 2
        )


def test_load_returns_an_existing_config_as_is():
    config = Config.load({"steps_per_print": 5})
    assert Config.load(config) is config


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* at line 3, column \d+") as caught:
        Config.load(path)
    assert str(path) in str(caught.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        Config.load(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("text", "kind"),
    [("[1, 2]", "a list"), ('"ds.json"', "a string"), ("3", "a number"), ("null", "null")],
)
def test_json_file_must_hold_an_object(tmp_path, text, kind):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"the top level must be a JSON object, got {kind}"):
        Config.load(path)


def test_duplicate_json_key_is_an_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"zero_optimization": {"stage": 1, "stage": 3}}')
    with pytest.raises(ConfigError, match="key 'stage' appears twice"):
        Config.load(path)


def test_source_of_wrong_type():
    with pytest.raises(
        ConfigError, match="a config must be a dict, a path to a JSON file or a Config, got list"
    ):
        Config.load([("train_batch_size", 8)])


def test_error_from_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"zero_optimization": {"stage": 9}}')
    with pytest.raises(
        ConfigError, match=f"invalid zerodist config {path}: 'zero_optimization.stage'"
    ):
        Config.load(path)


# --- defaults, "auto", immutability -------------------------------------------------------


def test_defaults_are_deepspeed_defaults():
    config = Config.load({})
    assert (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    ) == (None, None, None)
    assert config.optimizer is None and config.scheduler is None
    assert config.gradient_clipping == 0.0 and config.steps_per_print == 10
    assert not config.wall_clock_breakdown and not config.memory_breakdown
    fp16 = config.fp16
    assert (
        fp16.enabled,
        fp16.loss_scale,
        fp16.initial_scale_power,
        fp16.loss_scale_window,
        fp16.hysteresis,
        fp16.min_loss_scale,
    ) == (False, 0, 16, 1000, 2, 1)
    assert config.bf16.enabled is False
    zero = config.zero_optimization
    assert (
        zero.stage == 0 and zero.reduce_scatter and zero.overlap_comm and zero.contiguous_gradients
    )
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert config.comms_logger.model_dump() == {
        "enabled": False,
        "verbose": False,
        "prof_all": True,
        "prof_ops": [],
    }
    assert config.checkpoint.model_dump() == {
        "tag_validation": "Warn",
        "auto_resume": False,
        "save_interval": 0,
        "save_dir": None,
        "keep_last": 0,
        "max_failed_saves": 3,
        "skip_damaged": False,
        "agreement_timeout": None,
    }
    for monitor in (config.csv_monitor, config.tensorboard):
        assert monitor.model_dump() == {
            "enabled": False,
            "output_path": "",
            "job_name": "DeepSpeedJobName",
        }
    assert config.zerodist.timeout is None and config.zerodist.hang_warning is None
    assert config.zerodist.nonfinite_gradients == "skip"
    assert not config.zerodist.debug.collective_guard and not config.zerodist.debug.nan_check


def test_bucket_sizes_accept_floats_ints_and_auto():
    zero = Config.load(
        {
            "zero_optimization": {
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": "auto",
                "stage3_prefetch_bucket_size": 1000,
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 3e9,
            }
        }
    ).zero_optimization
    assert zero.reduce_bucket_size == 200_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 1000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 3_000_000_000


def test_auto_batch_sizes_count_as_absent():
    config = Config.load(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": "auto",
        }
    )
    assert config.train_batch_size is None and config.gradient_accumulation_steps is None
    assert config.batch_sizes(2, world_size_source="WORLD_SIZE=2") == BatchSizes(8, 4, 1)


def test_optimizer_and_scheduler_kept_as_given():
    config = Config.load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR"},
        }
    )
    assert config.optimizer.type == "AdamW" and config.optimizer.params == {
        "lr": 1e-3,
        "betas": [0.9, 0.95],
    }
    assert config.scheduler.type == "WarmupLR" and config.scheduler.params == {}


def test_config_is_frozen():
    config = Config.load({"zero_optimization": {"stage": 2}})
    with pytest.raises(ValidationError, match="frozen"):
        config.zero_optimization.stage = 3
    with pytest.raises(ValidationError, match="frozen"):
        config.gradient_clipping = 1.0
    assert config.zero_optimization.stage == 2


def test_to_dict_round_trips():
    config = Config.load(
        {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    )
    dumped = config.to_dict()
    assert dumped["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert Config.load(dumped) == config
    assert json.loads(json.dumps(dumped)) == dumped


# --- batch arithmetic ---------------------------------------------------------------------

# (train, micro, steps, world size) -> (train, micro, steps)
CONSISTENT_TRIPLES = [
    ((None, None, None, 1), (1, 1, 1)),
    ((None, None, None, 4), (4, 1, 1)),
    ((32, None, None, 1), (32, 32, 1)),
    ((32, None, None, 4), (32, 8, 1)),
    ((None, 4, None, 2), (8, 4, 1)),
    ((None, None, 3, 3), (9, 1, 3)),
    ((32, 4, None, 2), (32, 4, 4)),
    ((36, 4, None, 3), (36, 4, 3)),
    ((32, None, 2, 4), (32, 4, 2)),
    ((24, None, 4, 3), (24, 2, 4)),
    ((None, 4, 2, 2), (16, 4, 2)),
    ((None, 2, 5, 3), (30, 2, 5)),
    ((16, 4, 2, 2), (16, 4, 2)),
    ((48, 4, 4, 3), (48, 4, 4)),
    ((4, 4, 1, 1), (4, 4, 1)),
]


@pytest.mark.parametrize(
    ("given", "expected"), CONSISTENT_TRIPLES, ids=[str(case[0]) for case in CONSISTENT_TRIPLES]
)
def test_batch_triple_resolves(given, expected):
    train, micro, steps, world_size = given
    resolved = resolve_batch_sizes(
        train, micro, steps, world_size=world_size, world_size_source=f"WORLD_SIZE={world_size}"
    )
    assert resolved == BatchSizes(*expected)
    assert (
        resolved.train_batch_size
        == resolved.micro_batch_size * resolved.gradient_accumulation_steps * world_size
    )


# (train, micro, steps, world size) -> fragment
INCONSISTENT_TRIPLES = [
    (
        (32, 4, 2, 2),
        "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2)"
        " x data-parallel world size (2, from WORLD_SIZE=2) = 16",
    ),
    ((12, 4, 1, 4), "x data-parallel world size (4, from WORLD_SIZE=4) = 16"),
    (
        (30, 4, None, 2),
        "but 30 / (4 x 2) = 3.75 is not a whole number of gradient_accumulation_steps; the nearest train_batch_size that works is 24 or 32",
    ),
    (
        (30, None, 4, 2),
        "is not a whole number of train_micro_batch_size_per_gpu; the nearest train_batch_size that works is 24 or 32",
    ),
    (
        (10, None, None, 3),
        "train_batch_size (10) must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps (1) x data-parallel world size (3, from WORLD_SIZE=3)",
    ),
    ((8, 16, None, 1), "the nearest train_batch_size that works is 16"),
    ((2, None, None, 4), "the nearest train_batch_size that works is 4"),
]


@pytest.mark.parametrize(
    ("given", "fragment"), INCONSISTENT_TRIPLES, ids=[str(case[0]) for case in INCONSISTENT_TRIPLES]
)
def test_inconsistent_batch_triple_prints_the_equation(given, fragment):
    train, micro, steps, world_size = given
    with pytest.raises(ConfigError) as caught:
        resolve_batch_sizes(
            train, micro, steps, world_size=world_size, world_size_source=f"WORLD_SIZE={world_size}"
        )
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("train", "world_size", "fragment"),
    [
        (0, 1, "train_batch_size must be an integer >= 1"),
        (8, 0, "world size must be an integer >= 1, got 0 (from WORLD_SIZE=0)"),
    ],
)
def test_batch_inputs_are_checked(train, world_size, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        resolve_batch_sizes(
            train, None, None, world_size=world_size, world_size_source=f"WORLD_SIZE={world_size}"
        )


def test_config_batch_sizes_uses_the_config_values():
    config = Config.load({"train_batch_size": 32, "gradient_accumulation_steps": 2})
    assert config.batch_sizes(4, world_size_source="WORLD_SIZE=4") == BatchSizes(32, 4, 2)
    with pytest.raises(ConfigError, match=r"from --nproc-per-node=3"):
        config.batch_sizes(3, world_size_source="--nproc-per-node=3")


# --- show, docs, layering -----------------------------------------------------------------


def test_show_config_resolves_everything(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"reduce_bucket_size": "auto"},
            }
        )
    )
    shown = json.loads(show_config(path, world_size=4))
    assert (
        shown["train_batch_size"],
        shown["train_micro_batch_size_per_gpu"],
        shown["gradient_accumulation_steps"],
    ) == (8, 2, 1)
    assert shown["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert (
        shown["fp16"]["initial_scale_power"] == 16
        and shown["zerodist"]["debug"]["nan_check"] is False
    )
    assert '"auto"' not in json.dumps(shown)


def test_show_config_names_the_world_size_source():
    with pytest.raises(ConfigError, match=r"data-parallel world size \(3, from --world-size\)"):
        show_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}, world_size=3)


def test_docs_are_up_to_date():
    generated = render_defaults_markdown()
    written = (REPO_ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == generated, "regenerate with: python -m zerodist.config.docs > docs/config.md"


def test_docs_cover_every_key():
    generated = render_defaults_markdown()
    for section in ("`zero_optimization`", "`zerodist.debug`", "`checkpoint`", "`optimizer`"):
        assert f"## {section}" in generated
    assert "| `stage` | an integer from 0 to 3 | `0` |" in generated
    assert "## `zero_optimization.offload_param`" in generated


def test_config_layer_imports_neither_torch_nor_higher_layers():
    for module in (REPO_ROOT / "zerodist" / "config").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] != "torch", f"{module.name} imports {name}"
                if name.startswith("zerodist."):
                    assert name.split(".")[1] in (
                        "config",
                        "utils",
                    ), f"{module.name} imports {name}"
