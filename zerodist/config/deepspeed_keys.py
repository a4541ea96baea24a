"""DeepSpeed config keys that zerodist knows about but does not implement.

A DeepSpeed config that sets one of these would train differently under zerodist if the key
were silently dropped (no offload, no activation checkpointing, ...), so each one is an error
that says so. The tables are keyed by section: ``""`` is the top level.
"""

from __future__ import annotations


def _keys(names: str) -> tuple[str, ...]:
    # Whitespace-separated names keep the long lists readable and easy to extend.
    return tuple(sorted(names.split()))


NOT_IMPLEMENTED: dict[str, tuple[str, ...]] = {
    "": _keys("""
        activation_checkpointing aio amp autotuning comet communication_data_type
        compile compression_training curriculum_learning data_efficiency data_types
        dump_state eigenvalue elasticity flops_profiler gradient_predivide_factor
        graph_harvesting hybrid_engine nebula pipeline prescale_gradients
        progressive_layer_drop quantize_training seq_parallel_communication_data_type
        sparse_attention sparse_gradients timers torch_autocast wandb
        weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
        """),
    "zero_optimization": _keys("""
        allgather_partitions cpu_offload elastic_checkpoint ignore_unused_parameters
        legacy_stage1 load_from_fp32_weights log_trace_cache_warnings
        memory_efficient_linear mics_hierarchical_params_gather mics_shard_size
        offload_optimizer offload_param override_module_apply
        pipeline_loading_checkpoint round_robin_gradients
        stage3_gather_fp16_weights_on_model_save
        stage3_model_persistence_threshold stage3_module_granularity_threshold
        sub_group_size use_multi_rank_bucket_allreduce zero_hpz_partition_size
        zero_quantized_gradients zero_quantized_nontrainable_weights
        zero_quantized_weights zeropp_loco_param
        """),
    "fp16": _keys("auto_cast consecutive_hysteresis fp16_master_weights_and_grads"),
    "bf16": _keys("immediate_grad_update"),
    "comms_logger": _keys("debug"),
    "checkpoint": _keys("load_universal parallel_write use_node_local_storage"),
}

# Old DeepSpeed spellings of keys zerodist does implement: (section, old name) -> new name.
RENAMED: dict[tuple[str, str], str] = {
    ("", "bfloat16"): "bf16",
}


def not_implemented_message(path: str) -> str:
    return f"'{path}' is a DeepSpeed setting that zerodist does not implement yet; remove it"


def is_not_implemented(section: str, key: str) -> bool:
    return key in NOT_IMPLEMENTED.get(section, ())
