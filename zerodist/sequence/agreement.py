"""[Note: sequence shape agreement] The sequence-parallel exchanges (Ulysses' all-to-alls, the
ring's sends) need the same shapes on every rank of the sequence group; gloo checks that by
aborting the process (`Received data size doesn't match`, SIGABRT) on one rank while the other
waits. So before them the ranks agree on their shapes (`zerodist.comm.agree.agree_shapes`, one
fixed-size all-reduce) and a disagreement is `CollectiveMismatchError` on every rank:
- a `DistributedAttention` with its own group and a `RingAttention` agree on q, k, v (and the
  layout's dimensions and the element size) at every call;
- under the engine, the model's forward agrees once on the shapes of its tensor arguments (the
  pre-forward hook of zerodist/sequence/apply.py) and the attention layers inside, whose shapes
  follow from those and from a model structure every rank was checked to share at `initialize()`,
  skip it (`EngineSequence.shapes_agreed`). One all-reduce per forward instead of one per layer.
The backward exchanges need no check: autograd gives each one the shapes of its forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerodist.comm import Group
from zerodist.comm.agree import agree_shapes


def agree_attention_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, what: str,
                           dims: Sequence[int] = ()) -> None:
    """Every rank of `group` brings q, k, v of the same shapes and element size (and `dims`)."""
    agree_shapes([query.shape, key.shape, value.shape, (query.element_size(), *dims)], group,
                 what=f"{what}'s q, k, v ([shape of q], [k], [v], [element size, dims])", device=query.device)


def agree_call_shapes(tensors: Sequence[torch.Tensor], group: Group, what: str, device: torch.device) -> None:
    """Every rank of `group` calls the model with tensors of the same shapes, in the same order."""
    agree_shapes([t.shape for t in tensors], group, what=what, device=device)
