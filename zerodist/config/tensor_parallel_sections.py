"""The tensor-parallel sections of the config: DeepSpeed's `tensor_parallel` (autotp_size and the
layer specs by parameter-name pattern) and `zerodist.tensor_parallel` (what DeepSpeed has no key
for: Megatron-style sequence parallelism and Domino). Part of schema.py's `Config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerodist.config.fields import Section


class LayerSpecConfig(Section):
    patterns: list[str] = Field(
        min_length=1, description="Regular expressions over parameter names, e.g. \".*\\\\.q_proj\\\\.weight$\"."
    )
    partition_type: Literal["column", "row", "skip"] = Field(
        description="column: split the output features; row: split the input features; skip: replicate."
    )
    shape: list[int] | None = Field(
        None, description="[k, -1]: the weight fuses k equal sub-parameters (QKV: [3, -1]), each split on its own."
    )
    partition_dim: int = Field(0, description="Dimension a column layer splits; only 0 is supported.")
    gather_output: bool = Field(False, description="Column layers: all-gather the output (an LM head).")


class PartitionConfig(Section):
    use_default_specs: bool = Field(
        True, description="Accepted for DeepSpeed compatibility; zerodist applies layer_specs only."
    )
    layer_specs: list[LayerSpecConfig] = Field(
        default_factory=list, description="How the layers whose parameters match each pattern are split."
    )


class TensorParallelConfig(Section):
    autotp_size: int = Field(
        1, ge=1, description="Tensor-parallel degree (ranks per tensor-parallel group); 1 turns it off."
    )
    partition_config: PartitionConfig | None = Field(
        None, description="Layer specs by parameter-name pattern; absent uses the model's built-in plan "
        "(zerodist's GPT, Hugging Face models with a base_model_tp_plan)."
    )


class DominoSettings(Section):
    chunks: int = Field(2, ge=2, description="Domino: micro-batch chunks per block (any k >= 2).")
    overlap: Literal["intra", "inter"] = Field(
        "inter", description="intra: blocks wait for their reductions before returning; inter: the last "
        "chunk's reduction also runs under the next block's first chunk."
    )


class ZerodistTensorParallelConfig(Section):
    size: int | None = Field(
        None, ge=1, description="Tensor-parallel degree; the same as tensor_parallel.autotp_size (give one)."
    )
    sequence_parallel: bool = Field(
        False, description="Split activations along the sequence between tensor-parallel layers."
    )
    domino: DominoSettings | None = Field(
        None, description="Overlap tensor-parallel all-reduces with compute by splitting each block's batch."
    )
