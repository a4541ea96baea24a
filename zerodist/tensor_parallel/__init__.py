"""Layer 5: tensor parallelism over the `tensor` axis of a `Topology`, with Domino overlap.

- `operators`: the conjugate operators (copy-to / reduce-from the tensor region, gather /
  scatter along the last dim, sequence-parallel all-gather / reduce-scatter), autograd functions
  with explicit backwards, every collective through `zerodist.comm`.
- `layers`: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`; each declares
  its slices' placements, and cuts them with `zerodist.comm.slices`, which checkpoints read too.
- `cross_entropy`: `vocab_parallel_cross_entropy`.
- `plan`: `parallelize(model, plan, topology)` for a model the user wrote, DeepSpeed's
  `partition_config` form; `plans`: built-in plans (demo GPT, Hugging Face Llama and GPT-2).
- `conv1d`: column/row-parallel versions of Hugging Face's `Conv1D` (GPT-2).
- `shared_input`: one copy to the tensor region for the column layers reading one input (`PrepareInput`).
- `domino`: the k-chunk overlapped schedule (by residual branches, or, for any block, `chunks`:
  the chunks taking turns through the block's own forward); `schedule`: the log its overlap is
  measured from.
- `random`: the RNG tracker (named streams for replicated and sharded dropout).
See docs/tensor_parallel.md.
"""

from zerodist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from zerodist.tensor_parallel.layers import (
    SEQUENCE_PARTIAL,
    ColumnParallelLinear,
    RowParallelLinear,
    SliceSpec,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    slice_tensor,
    unslice_tensor,
)
from zerodist.tensor_parallel.plan import (
    Colwise,
    PlanError,
    PrepareInput,
    Replace,
    Replicate,
    Rowwise,
    Sequence,
    SequenceScatter,
    TiedHead,
    Vocab,
    parallelize,
    plan_from_deepspeed,
    reduce_partial_gradients,
    shared_inputs,
    sliced_parameters,
    unsliced_gradients,
    unsliced_state_dict,
)
from zerodist.tensor_parallel.domino import (
    ChunkedActivations,
    DominoBlock,
    DominoChunkError,
    DominoJoinError,
    DominoConfig,
    DominoStreamError,
    DominoTurns,
    ResidualBranch,
    apply_domino,
    find_blocks,
)
from zerodist.tensor_parallel.shared_input import SharedInput
from zerodist.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerodist.tensor_parallel.plans import (
    HeadParallelAttention,
    gpt_block_branches,
    gpt_domino,
    gpt_plan,
    hf_gpt2_plan,
    hf_llama_plan,
)
from zerodist.tensor_parallel.schedule import ScheduleLog, schedule_log
from zerodist.tensor_parallel.random import RNGTracker, attach_rng_tracker, rng_tracker_of, tensor_parallel_rng
from zerodist.tensor_parallel.operators import (
    TensorRegion,
    UnevenSplitError,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_from_tensor_region_,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)

__all__ = [
    "ChunkedActivations", "DominoBlock", "DominoChunkError", "DominoJoinError", "DominoConfig", "ResidualBranch", "ScheduleLog",
    "DominoStreamError", "DominoTurns", "PrepareInput", "SharedInput", "find_blocks", "shared_inputs",
    "apply_domino", "attach_rng_tracker", "gpt_block_branches", "gpt_domino", "rng_tracker_of", "schedule_log",
    "Colwise", "HeadParallelAttention", "PlanError", "RNGTracker", "Replace", "Replicate", "Rowwise", "Sequence",
    "SequenceScatter", "TiedHead", "Vocab", "gpt_plan", "hf_gpt2_plan", "hf_llama_plan", "parallelize",
    "plan_from_deepspeed", "reduce_partial_gradients", "sliced_parameters", "tensor_parallel_rng",
    "unsliced_gradients", "unsliced_state_dict",
    "ColumnParallelConv1D", "ColumnParallelLinear", "RowParallelConv1D", "RowParallelLinear", "SEQUENCE_PARTIAL",
    "SliceSpec", "TensorRegion", "TiedVocabParallelHead", "UnevenSplitError", "VocabParallelEmbedding",
    "copy_to_tensor_region", "gather_from_sequence_region", "gather_from_tensor_region",
    "reduce_from_tensor_region", "reduce_from_tensor_region_", "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region", "slice_tensor", "unslice_tensor", "vocab_parallel_cross_entropy",
]
