"""DeepSpeed's keys for training past one machine (issue 36; docs/zeropp.md): hierarchical sharding
(MiCS: `mics_shard_size`, `mics_hierarchical_params_gather`) inside `zero_optimization`, and the
gradient reduction's data type (`communication_data_type`, top level). Kept apart from schema.py,
which `ZeroConfig` there inherits these fields from.

[Note: HSDP naming] FSDP2 and torchtitan call hierarchical sharding HSDP and size it as
data_parallel_replicate_degree x data_parallel_shard_degree. `zerodist.hsdp: {shard_degree: S,
replicate_degree: R}` is that naming: before validation S is copied into
`zero_optimization.mics_shard_size` (so the run is MiCS's, bit for bit: tests/zero/test_hsdp.py),
and R, when given, is checked against the topology where the groups are built
(zerodist/zero/hierarchy.py): S x R must be the size of ZeRO's group."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from zerodist.config.fields import Section

# DeepSpeed's spellings of the gradient reduction's data type.
CommunicationDataType = Literal["fp32", "fp16", "bf16"]


class HierarchicalShardingKeys(Section):
    """The `zero_optimization` keys of hierarchical sharding (inherited by `ZeroConfig`)."""

    mics_shard_size: int = Field(
        -1, ge=-1, description="MiCS / HSDP: shard parameters, gradients and optimizer state within groups of this "
        "many consecutive ranks of ZeRO's group (each tensor rank's and each pipeline stage's data group, times "
        "the sequence degree with Ulysses) and replicate them across the groups; gradients are reduce-scattered "
        "within a group, then all-reduced across groups. -1 (or the group's size) shards over all of them (plain "
        "ZeRO). Must divide that size; not with expert parallelism. zerodist.hsdp is the same key in FSDP2's "
        "naming. See docs/zeropp.md."
    )
    zero_hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ (stage 3): after a training forward's all-gather each rank keeps a secondary "
        "copy of the parameters sharded within blocks of this many consecutive ranks (the ranks per node), which the "
        "backward all-gather reads, so it never leaves the node; costs Ψ/size elements per rank between forward and "
        "backward. 1 turns it off. Must divide the data-parallel (or MiCS shard) degree; not with parameter offload, "
        "a pipeline or expert parallelism. "
        "See docs/zeropp.md."
    )
    zero_quantized_weights: bool = Field(
        False, description="ZeRO++ qwZ (stage 3): all-gather the parameters block-quantized to int8 with an fp32 scale "
        "per block, and dequantize on arrival (every rank computes with the same dequantized weights; the shards "
        "the optimizer steps stay exact). About half the gather's bf16 bytes, a quarter of fp32's."
    )
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++: quantize frozen parameters' gathers too. zerodist does not shard frozen "
        "parameters (they are replicated, never gathered), so this is accepted and changes nothing."
    )
    zero_quantized_gradients: bool = Field(
        False, description="ZeRO++ qgZ (stage 3): reduce-scatter gradients by all-to-all of int4 block-quantized "
        "chunks, within the node and then across nodes (hierarchical when the data-parallel ranks span nodes), "
        "dequantized and summed in fp32. Needs reduce_scatter true."
    )
    mics_hierarchical_params_gather: bool = Field(
        False, description="MiCS: gather parameters within the node first, then across nodes. zerodist accepts it "
        "where a shard group lies within one node (the gather never leaves it, so there is nothing to stage); a shard "
        "group that spans nodes with this key true is refused."
    )


class HsdpConfig(Section):
    """`zerodist.hsdp`: FSDP2 / torchtitan's names for hierarchical sharding (HSDP), mapped onto MiCS."""

    shard_degree: int = Field(
        ..., ge=1, description="HSDP (FSDP2's data_parallel_shard_degree): shard within groups of this many "
        "consecutive ranks of ZeRO's group and replicate across them; the same as "
        "zero_optimization.mics_shard_size (give one, or both equal)."
    )
    replicate_degree: int | None = Field(
        None, ge=1, description="HSDP (FSDP2's data_parallel_replicate_degree): how many replicas; checked, not "
        "chosen: shard_degree x replicate_degree must be the size of ZeRO's group (the data-parallel degree, "
        "times the sequence degree with Ulysses). null: whatever shard_degree leaves."
    )


def apply_hsdp_alias(data: Any) -> Any:
    """Before validation: `zerodist.hsdp.shard_degree` becomes `zero_optimization.mics_shard_size`, so
    everything downstream sees one key ([Note: HSDP naming]). Both given and different: refused."""
    if not isinstance(data, dict) or not isinstance(data.get("zerodist"), dict):
        return data
    hsdp = data["zerodist"].get("hsdp")
    if not isinstance(hsdp, dict) or "shard_degree" not in hsdp:
        return data
    zero = data.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    given = zero.get("mics_shard_size", -1)
    if given not in (-1, hsdp["shard_degree"]):
        raise ValueError(f"'zerodist.hsdp.shard_degree' ({hsdp['shard_degree']!r}) and "
                         f"'zero_optimization.mics_shard_size' ({given!r}) name the same shard group size differently; "
                         "give one of them")
    zero["mics_shard_size"] = hsdp["shard_degree"]
    return {**data, "zero_optimization": zero}


def zeropp_problems(zero: HierarchicalShardingKeys, stage: int, reduce_scatter: bool) -> list[str]:
    """The ZeRO++ keys' combinations that cannot work, named."""
    asked = [key for key, on in (("zero_hpz_partition_size", zero.zero_hpz_partition_size > 1),
                                 ("zero_quantized_weights", zero.zero_quantized_weights),
                                 ("zero_quantized_gradients", zero.zero_quantized_gradients)) if on]
    problems = []
    if asked and stage != 3:
        problems.append(f"{', '.join(repr('zero_optimization.' + key) for key in asked)} extend ZeRO stage 3's "
                        f"gathers and reductions, but 'zero_optimization.stage' is {stage}; set stage 3 or remove them")
    if zero.zero_quantized_gradients and not reduce_scatter:
        problems.append("'zero_optimization.zero_quantized_gradients' replaces the gradient reduce-scatter, but "
                        "'zero_optimization.reduce_scatter' is false; set it to true or remove zero_quantized_gradients")
    return problems


def communication_dtype_problem(value: str | None, fp16: bool, bf16: bool) -> str | None:
    """Why `communication_data_type` cannot be used with this precision, or None."""
    if value == "fp16" and bf16:
        return ("'communication_data_type' is fp16 but 'bf16.enabled' is true: reducing bf16 gradients in fp16 "
                "loses range; use fp32 or bf16")
    if value == "bf16" and fp16:
        return ("'communication_data_type' is bf16 but 'fp16.enabled' is true: reducing fp16 gradients in bf16 "
                "loses precision; use fp32 or fp16")
    return None
