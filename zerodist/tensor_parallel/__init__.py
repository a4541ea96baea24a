"""Layer 5: tensor parallelism over the `tensor` axis of a `Topology`, with Domino overlap.

- `operators`: the conjugate operators (copy-to / reduce-from the tensor region, gather /
  scatter along the last dim, sequence-parallel all-gather / reduce-scatter), autograd functions
  with explicit backwards, every collective through `zerodist.comm`.
- `layers`: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`.
- `cross_entropy`: `vocab_parallel_cross_entropy`.
See docs/tensor_parallel.md.
"""

from zerodist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from zerodist.tensor_parallel.layers import (
    SEQUENCE_PARTIAL,
    ColumnParallelLinear,
    RowParallelLinear,
    SliceSpec,
    VocabParallelEmbedding,
    slice_tensor,
    unslice_tensor,
)
from zerodist.tensor_parallel.operators import (
    TensorRegion,
    UnevenSplitError,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "SEQUENCE_PARTIAL", "SliceSpec", "TensorRegion", "UnevenSplitError",
    "VocabParallelEmbedding", "copy_to_tensor_region", "gather_from_sequence_region", "gather_from_tensor_region",
    "reduce_from_tensor_region", "reduce_scatter_to_sequence_region", "scatter_to_sequence_region",
    "scatter_to_tensor_region", "slice_tensor", "unslice_tensor", "vocab_parallel_cross_entropy",
]
