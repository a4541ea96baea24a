"""DeepSpeed's keys for training past one machine (issue 36; docs/zeropp.md): hierarchical sharding
(MiCS: `mics_shard_size`, `mics_hierarchical_params_gather`) inside `zero_optimization`, and the
gradient reduction's data type (`communication_data_type`, top level). Kept apart from schema.py,
which `ZeroConfig` there inherits these fields from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerodist.config.fields import Section

# DeepSpeed's spellings of the gradient reduction's data type.
CommunicationDataType = Literal["fp32", "fp16", "bf16"]


class HierarchicalShardingKeys(Section):
    """The `zero_optimization` keys of hierarchical sharding (inherited by `ZeroConfig`)."""

    mics_shard_size: int = Field(
        -1, ge=-1, description="MiCS / HSDP: shard parameters, gradients and optimizer state within groups of this "
        "many consecutive data-parallel ranks and replicate them across the groups; gradients are reduce-scattered "
        "within a group, then all-reduced across groups. -1 (or the data degree) shards over all of them (plain "
        "ZeRO). Must divide the data-parallel degree; not with tensor, sequence, expert or pipeline parallelism "
        "nor with offload. See docs/zeropp.md."
    )
    zero_hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ (stage 3): after a training forward's all-gather each rank keeps a secondary "
        "copy of the parameters sharded within blocks of this many consecutive ranks (the ranks per node), which the "
        "backward all-gather reads, so it never leaves the node; costs Ψ/size elements per rank between forward and "
        "backward. 1 turns it off. Must divide the data-parallel (or MiCS shard) degree; not with parameter offload. "
        "See docs/zeropp.md."
    )
    mics_hierarchical_params_gather: bool = Field(
        False, description="MiCS: gather parameters within the node first, then across nodes. zerodist accepts it "
        "where a shard group lies within one node (the gather never leaves it, so there is nothing to stage); a shard "
        "group that spans nodes with this key true is refused."
    )


def communication_dtype_problem(value: str | None, fp16: bool, bf16: bool) -> str | None:
    """Why `communication_data_type` cannot be used with this precision, or None."""
    if value == "fp16" and bf16:
        return ("'communication_data_type' is fp16 but 'bf16.enabled' is true: reducing bf16 gradients in fp16 "
                "loses range; use fp32 or bf16")
    if value == "bf16" and fp16:
        return ("'communication_data_type' is bf16 but 'fp16.enabled' is true: reducing fp16 gradients in bf16 "
                "loses precision; use fp32 or fp16")
    return None
