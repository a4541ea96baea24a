"""Layer 5: sequence parallelism. Each rank holds a slice of every sample's sequence.

- `layer.DistributedAttention`: DeepSpeed-Ulysses (all-to-all sequence <-> heads around any local
  attention), DeepSpeed's class and arguments.
- `ring.RingAttention` / `ring.ring_attention`: blockwise attention merged by log-sum-exp, for
  any degree, causal with the head-tail load balance.
- `layout`: which tokens a rank holds, the divisibility rules, the byte formulas (pure).
- `data`: the data-loader adapter that hands each sequence rank its slice, position ids and
  shifted labels included.
- `loss`: the token-weighted loss over the whole sequence.
- `hf`: attention for Hugging Face models through transformers' attention-function registry.
- `agreement`: the ranks agree on the shapes before the exchanges (a disagreement is a named
  error on every rank, not a gloo abort).
- `apply`: `apply_sequence_parallel`, the engine's front door (with tensor parallelism too), and
  DeepSpeed's manual mode (`method: manual`: the groups only).
- `head_exchange`: DeepSpeed's 5-argument `_SeqAllToAll` (layout from `batch_dim_idx`, uneven heads).
See docs/sequence_parallel.md.
"""

from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.layer import DistributedAttention
from zerodist.sequence.layout import SequenceLayout
from zerodist.sequence.ring import RingAttention, ring_attention

__all__ = ["DistributedAttention", "RingAttention", "SequenceLayout", "SequenceParallelError", "ring_attention"]
