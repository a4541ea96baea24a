"""DeepSpeed config keys that zerodist knows about but does not implement.

A DeepSpeed config that sets one of these would train differently under zerodist if the key
were silently dropped (no activation checkpointing, no quantization, ...), so each one is an error
that says so. The tables are keyed by section: ``""`` is the top level.

Some values of those keys ask for nothing zerodist lacks: a disabled legacy offload
(``"cpu_offload": false``), a default (``"allgather_partitions": true``), a feature section with
``"enabled": false``. DeepSpeed's own tutorials write them, so ``NO_OP_VALUES`` lists them;
``drop_no_op_keys`` removes them before validation and names them in one info line. Any other
value of the key is still refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from zerodist.config.offload_sections import is_valid_aio_section
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)


def _keys(names: str) -> tuple[str, ...]:
    # Whitespace-separated names keep the long lists readable and easy to extend.
    return tuple(sorted(names.split()))


NOT_IMPLEMENTED: dict[str, tuple[str, ...]] = {
    "": _keys("""
        activation_checkpointing amp autotuning
        dataloader_drop_last disable_allgather fp32_allreduce use_data_before_expert_parallel_
        compile compression_training curriculum_learning data_efficiency data_types
        dump_state eigenvalue elasticity gradient_allreduce_op gradient_predivide_factor
        graph_harvesting hybrid_engine nebula prescale_gradients
        progressive_layer_drop quantize_training seq_parallel_communication_data_type
        sparse_attention sparse_gradients timers torch_autocast
        weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
        """),
    "zero_optimization": _keys("""
        allgather_partitions compute_grad_norm cpu_offload cpu_offload_param
        cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks ignore_unused_parameters
        leaf_module legacy_stage1 load_from_fp32_weights log_trace_cache_warnings
        memory_efficient_linear
        override_module_apply parameter_alignment
        pipeline_loading_checkpoint round_robin_gradients
        stage3_allgather_sequential stage3_gather_fp16_weights_on_model_save
        stage3_model_persistence_threshold stage3_module_granularity_threshold
        stage3_use_all_reduce_for_fetch_params
        use_multi_rank_bucket_allreduce zenflow
        zeropp_loco_param
        """),
    "fp16": _keys("auto_cast consecutive_hysteresis fp16_master_weights_and_grads"),
    "bf16": _keys("bf16_master_weights_and_grads bf16_optimizer_states check_grad_overflow immediate_grad_update"),
    "comms_logger": _keys("debug"),
    "checkpoint": _keys("load_universal parallel_write use_node_local_storage"),
    "pipeline": _keys("stages partition seed_layers pipe_partitioned grad_partitioned"),
    "optimizer": _keys("legacy_fusion"),
}

# Old DeepSpeed spellings of keys zerodist does implement: (section, old name) -> new name.
RENAMED: dict[tuple[str, str], str] = {
    ("", "bfloat16"): "bf16",
}

# DeepSpeed's ZeRO-3 fields are named without the `stage3_` prefix and take the prefixed name as a
# pydantic alias (populate_by_name), so either spelling configures the same field; axolotl's
# templates write `max_live_parameters`. Un-prefixed name -> the name zerodist's schema uses.
ZERO_ALIASES: dict[str, str] = {
    name: f"stage3_{name}" for name in _keys("""
        prefetch_bucket_size param_persistence_threshold model_persistence_threshold
        max_live_parameters max_reuse_distance gather_16bit_weights_on_model_save
        module_granularity_threshold use_all_reduce_for_fetch_params allgather_sequential
        """)
}

# Top-level keys DeepSpeed reads nothing from: its top level is read key by key and ignores the
# rest. `comms_config` and `monitor_config` are the names of DeepSpeed's *parsed* sections
# (`DeepSpeedConfig.comms_config` comes from `comms_logger`, `.monitor_config` from `tensorboard`,
# `csv_monitor`, `wandb`, `comet`), so a key of that name in the JSON configures nothing there
# either; LLaMA-Factory's templates write both. A top-level key starting with "_" is a comment.
IGNORED_BY_DEEPSPEED: dict[str, str] = {
    "comms_config": "the collective tracer is 'comms_logger'",
    "monitor_config": "monitors are the top-level 'csv_monitor', 'tensorboard', 'wandb' and 'comet' sections",
}


def not_implemented_message(path: str, section: str = "", key: str = "") -> str:
    accepted = no_op_values(section, key)
    if accepted is None:
        return f"'{path}' is a DeepSpeed setting that zerodist does not implement yet; remove it"
    return (f"'{path}' is a DeepSpeed setting that zerodist does not implement yet; remove it (accepted, as "
            f"changing nothing here: {accepted})")


def is_not_implemented(section: str, key: str) -> bool:
    return key in NOT_IMPLEMENTED.get(section, ())


def _same(expected: Any) -> Callable[[Any], bool]:
    """Equal to `expected` in JSON's sense: `true` is not `1`, `1.0` is `1`."""
    def matches(value: Any) -> bool:
        if isinstance(expected, bool) or expected is None:
            return value is expected
        if isinstance(value, bool):
            return False
        return value == expected
    return matches


def _lowercase_is(expected: str) -> Callable[[Any], bool]:
    """A string equal to `expected` in any case (DeepSpeed lowercases the value before checking it)."""
    return lambda value: isinstance(value, str) and value.lower() == expected


def _any_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _stages(value: Any) -> bool:
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def _partition(value: Any) -> bool:
    return isinstance(value, str) and (value in ("best", "uniform", "parameters") or value.startswith("type:"))


def _disabled_section(value: Any) -> bool:
    """A feature section switched off: `{"enabled": false, ...}` (its other keys then do nothing)."""
    return isinstance(value, Mapping) and value.get("enabled", None) is False


def _all_off(value: Any) -> bool:
    """A section whose every setting is false or null (activation_checkpointing's defaults)."""
    return isinstance(value, Mapping) and all(v is False or v is None for v in value.values())


_OFF_SECTION = (_disabled_section, 'a section with "enabled": false')

# DeepSpeed's "pipeline" section: `stages`, `partition` and `seed_layers` are PipelineModule's arguments (DeepSpeed's
# engine reads none of them from the config); `pipe_partitioned` and `grad_partitioned` split the activations and
# gradients a stage sends over the tensor-parallel ranks (the same values arrive): accepted with the info line.
# `activation_checkpoint_interval` and `use_reentrant` mean what they do in DeepSpeed (Config.pipeline).
# DeepSpeed's "aio" section tunes its libaio swap I/O (NVMe offload); zerodist's swap files are read and
# written by its own pread/pwrite threads (docs/offload.md), whose results do not depend on these.
AIO_KEYS = frozenset(_keys("block_size queue_depth intra_op_parallelism thread_count single_submit overlap_events "
                           "use_gds"))


# (section, key) -> (the values that change nothing here, those values in words).
NO_OP_VALUES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("", "prescale_gradients"): (_same(False), "false"),
    ("", "gradient_predivide_factor"): (_same(1.0), "1.0"),
    # DeepSpeed 0.19's data-parallel gradient op: "mean" (its default) is what zerodist does; "sum" (gradients
    # world-size times larger) is not implemented, and must not be dropped as an unknown key would be.
    # DeepSpeed lowercases the value first, so "MEAN" is its "mean" (and "Sum" its "sum", refused).
    ("", "gradient_allreduce_op"): (_lowercase_is("mean"), '"mean" (any case, as DeepSpeed lowercases it)'),
    ("", "sparse_gradients"): (_same(False), "false"),
    # Whether DeepSpeed copies gradients into one contiguous buffer (memory layout only): zerodist always
    # copies them into flat buckets as they are produced, and the reduced gradients are the same either way.
    ("zero_optimization", "contiguous_gradients"): (_same(False), "false (zerodist always copies gradients "
                                                    "into flat contiguous buckets; the result is the same)"),
    ("", "dump_state"): (_same(False), "false"),
    ("", "graph_harvesting"): (_same(False), "false"),
    # Any torch.optim optimizer runs under every ZeRO stage, and the CPU optimizer only matters with offload.
    ("", "zero_allow_untested_optimizer"): (_any_bool, "true or false"),
    ("", "zero_force_ds_cpu_optimizer"): (_any_bool, "true or false (the torch optimizer steps offloaded state)"),
    ("", "activation_checkpointing"): (_all_off, "every setting false or null"),
    ("pipeline", "stages"): (_stages, '"auto" or a positive int (the PipelineModule\'s num_stages decides)'),
    ("pipeline", "partition"): (_partition, '"best", "uniform", "parameters" or "type:<regex>" (the '
                                'PipelineModule\'s partition_method decides)'),
    ("pipeline", "seed_layers"): (_any_bool, "true or false (the PipelineModule's seed_layers decides)"),
    ("pipeline", "pipe_partitioned"): (_any_bool, "true or false (the same activations arrive)"),
    ("pipeline", "grad_partitioned"): (_any_bool, "true or false (the same gradients arrive)"),
    # Only a section whose values have DeepSpeed's types: another stays, and the schema's AioConfig names the key.
    ("", "aio"): (is_valid_aio_section, "DeepSpeed's aio keys (" + ", ".join(sorted(AIO_KEYS))
                  + ", each of its type: integers > 0, booleans): tuning of DeepSpeed's own swap I/O"),
    **{("", name): _OFF_SECTION for name in (
        "amp", "nebula", "elasticity", "autotuning", "curriculum_learning",
        "data_efficiency", "progressive_layer_drop", "eigenvalue", "hybrid_engine", "torch_autocast",
        "quantize_training")},
    ("zero_optimization", "allgather_partitions"): (_same(True), "true"),
    ("zero_optimization", "cpu_offload"): (_same(False), "false"),
    ("zero_optimization", "cpu_offload_param"): (_same(False), "false"),
    ("zero_optimization", "cpu_offload_use_pin_memory"): (_same(False), "false"),
    # zerodist checkpoints load at any world size and stage, which is what this asks for.
    ("zero_optimization", "elastic_checkpoint"): (_any_bool, "true or false (checkpoints always reshard)"),
    ("zero_optimization", "ignore_unused_parameters"): (_same(True), "true"),
    ("zero_optimization", "legacy_stage1"): (_same(False), "false"),
    ("zero_optimization", "load_from_fp32_weights"): (_same(True), "true"),
    ("zero_optimization", "log_trace_cache_warnings"): (_same(False), "false"),
    ("zero_optimization", "memory_efficient_linear"): (_any_bool, "true or false (torch's linear is never replaced)"),
    ("zero_optimization", "override_module_apply"): (_same(True), "true"),
    ("zero_optimization", "pipeline_loading_checkpoint"): (_same(False), "false"),
    # An offload copy schedule (which rank copies which gradient to the host): the gradients are the same.
    ("zero_optimization", "round_robin_gradients"): (_any_bool, "true or false (gradients are the same either way)"),
    ("zero_optimization", "stage3_gather_fp16_weights_on_model_save"): (_same(False), "false"),
    ("zero_optimization", "stage3_module_granularity_threshold"): (_same(0), "0"),
    ("zero_optimization", "use_multi_rank_bucket_allreduce"): (_same(True), "true"),
    ("zero_optimization", "zeropp_loco_param"): (_same(None), "null"),
    ("zero_optimization", "compute_grad_norm"): (_same(True), "true"),
    ("zero_optimization", "parameter_alignment"): (_same(False), "false"),
    ("zero_optimization", "enable_sanity_checks"): (_same(False), "false"),
    ("zero_optimization", "stage3_use_all_reduce_for_fetch_params"): (_same(False), "false"),
    ("zero_optimization", "stage3_allgather_sequential"): (_same(False), "false"),
    ("fp16", "fp16_master_weights_and_grads"): (_same(False), "false"),
    ("fp16", "consecutive_hysteresis"): (_same(False), "false"),
    ("fp16", "auto_cast"): (_same(False), "false"),
    ("bf16", "immediate_grad_update"): (_same(False), "false"),
    ("bf16", "bf16_master_weights_and_grads"): (_same(False), "false"),
    ("bf16", "bf16_optimizer_states"): (_same(False), "false"),
    ("bf16", "check_grad_overflow"): (_same(False), "false (zerodist does not skip bf16 steps on overflow)"),
    ("comms_logger", "debug"): (_same(False), "false"),
    ("checkpoint", "load_universal"): (_same(False), "false"),
    ("checkpoint", "use_node_local_storage"): (_same(False), "false"),
}


def no_op_values(section: str, key: str) -> str | None:
    """The accepted values of a not-implemented key, in words, or None when no value is accepted."""
    entry = NO_OP_VALUES.get((section, key))
    return None if entry is None else entry[1]


def is_ignored_by_deepspeed(key: str) -> bool:
    return key in IGNORED_BY_DEEPSPEED or key.startswith("_")


def unalias_zero_keys(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`raw` with `zero_optimization`'s un-prefixed DeepSpeed names under their `stage3_` names,
    and the problems: both spellings of one field given."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, Mapping) or not any(key in ZERO_ALIASES for key in zero):
        return raw, []
    renamed: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    problems = []
    for key, value in zero.items():
        name = ZERO_ALIASES.get(key, key)
        if name in renamed:
            problems.append(f"'zero_optimization.{given_as[name]}' and 'zero_optimization.{key}' are one "
                            "DeepSpeed setting under two names; give one")
        renamed[str(name)], given_as[str(name)] = value, key
    return {**raw, "zero_optimization": renamed}, problems


def drop_no_op_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without the DeepSpeed keys whose values change nothing here, named in one info line
    (on rank 0). Other values stay, so validation refuses them with the reason."""
    dropped = [f"{key} (DeepSpeed ignores it{'; ' + IGNORED_BY_DEEPSPEED[key] if key in IGNORED_BY_DEEPSPEED else ''})"
               for key in raw if is_ignored_by_deepspeed(key)]
    raw = {key: value for key, value in raw.items() if not is_ignored_by_deepspeed(key)}
    result = _without_no_op(raw, "", dropped)
    for section, value in raw.items():
        if isinstance(value, Mapping) and any(s == section for s, _ in NO_OP_VALUES):
            result[section] = _without_no_op(value, section, dropped)
    if dropped:
        log_rank0(logger, "config: ignoring DeepSpeed settings that change nothing in zerodist: %s", ", ".join(dropped))
    return result


def _without_no_op(section_value: Mapping[str, Any], section: str, dropped: list[str]) -> dict[str, Any]:
    kept = {}
    for key, value in section_value.items():
        entry = NO_OP_VALUES.get((section, key))
        if entry is not None and entry[0](value):
            dropped.append(f"{section + '.' if section else ''}{key}={_show(value)}")
        else:
            kept[key] = value
    return kept


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return '{"enabled": false, ...}' if value.get("enabled", None) is False else "{...}"
    return json.dumps(value)
