"""DeepSpeed-Ulysses: `DistributedAttention(local_attention, sequence_process_group, scatter_idx=2,
gather_idx=0)`, DeepSpeed's class and meaning.

Each rank holds a slice of the sequence for every head. Before attention one all-to-all per
tensor (q, k, v) trades sequence for heads, so each rank holds the whole sequence for H/P heads
and runs any local attention on it, unchanged; a last all-to-all trades back. `scatter_idx` is
the heads dimension of the inputs (scattered over the ranks), `gather_idx` the sequence dimension
(gathered): DeepSpeed's defaults 2 and 0 are for [seq, batch, heads, head_dim], and
[batch, seq, heads, head_dim] takes `scatter_idx=2, gather_idx=1`.

`sequence_process_group` is a process group, as DeepSpeed takes it, or None: the engine's
`sequence` axis once `zerodist.initialize()` ran with `sequence_parallel_size` > 1 (registered in
a side table, nothing written on the module), and plain local attention before that or at degree
1, so a model written with it runs unchanged on one process.

Grouped key/value heads travel as they are when the degree divides them, and are replicated up to
the degree when there are fewer ([Note: replicated kv heads]). An engine configured with
`zerodist.sequence_parallel.method: ring` runs the ring instead (zerodist/sequence/ring.py), for
any degree; the local attention is then not called.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm import tracer
from zerodist.comm import Group
from zerodist.sequence import head_exchange
from zerodist.sequence.agreement import agree_attention_shapes
from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.layout import SequenceLayout, check_heads
from zerodist.sequence.ring import ring_attention


class _SeqAllToAll(torch.autograd.Function):
    """Split `input` into P pieces along `scatter_idx`, send piece i to rank i, and concatenate what
    arrives along `gather_idx`, in rank order. Its backward is the same exchange the other way.

    DeepSpeed's longer form, `apply(group, input, scatter_idx, gather_idx, batch_dim_idx, stream=None,
    handle=None, type=None, is_fwd=True, num_kv_heads=None)`, has DeepSpeed's meaning: the layout
    comes from `batch_dim_idx`, and heads the degree does not divide are dealt by DeepSpeed's rule
    ([Note: DeepSpeed's head exchange] in zerodist/sequence/head_exchange.py). `stream`, `handle`,
    `type` and `is_fwd` are DeepSpeed's CUDA-stream overlap; the exchange runs in order here."""

    @staticmethod
    def forward(ctx: Any, group: Group, input: torch.Tensor, scatter_idx: int, gather_idx: int,
                batch_dim_idx: int | None = None, stream: Any = None, handle: Any = None, type: Any = None,
                is_fwd: bool = True, num_kv_heads: int | None = None) -> torch.Tensor:
        ctx.group = group
        if batch_dim_idx is not None or num_kv_heads is not None:
            ctx.plan = head_exchange.plan(input, group, scatter_idx, batch_dim_idx if batch_dim_idx is not None else 0,
                                          num_kv_heads)
            return head_exchange.exchange(input, group, *ctx.plan)
        ctx.plan, ctx.scatter_idx, ctx.gather_idx = None, scatter_idx, gather_idx
        return seq_all_to_all(input, group, scatter_idx, gather_idx)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.plan is not None:  # the same exchange the other way, with the sizes the forward saw
            scatter_dim, gather_dim, scatter_sizes, gather_sizes = ctx.plan
            grad = head_exchange.exchange(grads[0].contiguous(), ctx.group, gather_dim, scatter_dim, gather_sizes,
                                          scatter_sizes)
        else:
            grad = seq_all_to_all(grads[0], ctx.group, ctx.gather_idx, ctx.scatter_idx)
        # one gradient per forward argument, however many the call passed (autograd drops the extra Nones)
        return (None, grad, *([None] * 8))


def seq_all_to_all(input: torch.Tensor, group: Group, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    """The exchange itself (no autograd): one `all_to_all_single` of the whole tensor."""
    size = comm.get_world_size(group)
    if input.shape[scatter_idx] % size:
        raise SequenceParallelError(f"dimension {scatter_idx} of a {tuple(input.shape)} tensor is not divisible by "
                                    f"the {size} sequence-parallel ranks it is split over")
    pieces = torch.stack(input.chunk(size, dim=scatter_idx)).contiguous()  # piece i goes to rank i
    received = torch.empty_like(pieces)
    with tracer.labelled("sequence"):  # told from an MoE layer's all-to-alls in a trace (zerodist train --moe --sp)
        comm.all_to_all_single(received, pieces, group=group)
    return torch.cat(received.unbind(0), dim=gather_idx)


def all_to_all(input: torch.Tensor, group: Group, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    """Differentiable sequence <-> heads all-to-all (DeepSpeed's `_SeqAllToAll.apply`)."""
    return _SeqAllToAll.apply(group, input, scatter_idx, gather_idx)


@dataclasses.dataclass(frozen=True)
class EngineSequence:
    """What `initialize()` registers for a `DistributedAttention` built with no group: the engine's
    sequence group, the method, and (for the ring) this rank's layout and the mask."""

    group: Group
    method: str  # "ulysses" or "ring"
    layout: SequenceLayout
    causal: bool = True
    # the engine agreed the shapes at the model's forward ([Note: sequence shape agreement])
    shapes_agreed: bool = False


# DistributedAttention -> the engine's settings for it (weak: nothing is written on the module)
_ENGINE: weakref.WeakKeyDictionary[torch.nn.Module, EngineSequence] = weakref.WeakKeyDictionary()


def register_engine_sequence(module: torch.nn.Module, settings: EngineSequence | None) -> None:
    """Give (or with None, take back) the engine's sequence settings to a module."""
    if settings is None:
        _ENGINE.pop(module, None)
    else:
        _ENGINE[module] = settings


def engine_sequence(module: torch.nn.Module) -> EngineSequence | None:
    return _ENGINE.get(module)


def replicate_kv_heads(tensor: torch.Tensor, heads_dim: int, degree: int) -> torch.Tensor:
    """[Note: replicated kv heads] With fewer key/value heads than ranks, each head is repeated
    degree / heads times (adjacent copies), so rank r receives head r * heads / degree: the one
    its query heads r H/P ... (r+1) H/P - 1 are grouped with. The repeat's backward sums the copies'
    gradients back into the one head."""
    heads = tensor.shape[heads_dim]
    if heads >= degree:
        return tensor
    return tensor.repeat_interleave(degree // heads, dim=heads_dim)


def layout_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, scatter_idx: int,
                    gather_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """All-to-all q, k, v from sequence slices to head slices (`scatter_idx` the heads, `gather_idx`
    the sequence), evenly; returns them and the way back for the context."""
    degree = comm.get_world_size(group)
    check_heads(query.shape[scatter_idx], key.shape[scatter_idx], degree)
    key = replicate_kv_heads(key, scatter_idx, degree)
    value = replicate_kv_heads(value, scatter_idx, degree)
    q, k, v = (all_to_all(t, group, scatter_idx, gather_idx) for t in (query, key, value))
    return q, k, v, lambda context: all_to_all(context, group, gather_idx, scatter_idx)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, scatter_idx: int,
                      gather_idx: int, local_attention: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """All-to-all q, k, v from sequence slices to head slices, the local attention over the whole
    sequence, and back."""
    q, k, v, back = layout_exchange(query, key, value, group, scatter_idx, gather_idx)
    return back(local_attention(q, k, v, *args, **kwargs))


def deepspeed_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, scatter_idx: int,
                       gather_idx: int, batch_dim_idx: int, num_kv_heads: int | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """DeepSpeed's `DistributedAttention` exchange with `batch_dim_idx`: the layout is [batch, seq,
    heads, head_dim] (0) or [seq, batch, heads, head_dim] (1) whatever the two indices say; q, k and v
    go through the 5-argument exchange with `num_kv_heads` (DeepSpeed's: the key's head count when
    not given) as the key/value group count, so a query head lands on the rank holding its key/value
    head, and heads the degree does not divide are dealt by DeepSpeed's rule ([Note: DeepSpeed's head
    exchange]). Fewer key/value heads than ranks are replicated up to the degree first ([Note:
    replicated kv heads]; DeepSpeed refuses them). Returns q, k, v and the way back for the context."""
    degree = comm.get_world_size(group)
    kv_heads = num_kv_heads if num_kv_heads is not None else key.shape[head_exchange.HEADS_DIM]
    if kv_heads < degree:
        key = replicate_kv_heads(key, head_exchange.HEADS_DIM, degree)
        value = replicate_kv_heads(value, head_exchange.HEADS_DIM, degree)
        kv_heads = degree
    q, k, v = (_SeqAllToAll.apply(group, t, scatter_idx, gather_idx, batch_dim_idx, None, None, None, True, kv_heads)
               for t in (query, key, value))

    def back(context: torch.Tensor) -> torch.Tensor:
        return _SeqAllToAll.apply(group, context, gather_idx, scatter_idx, batch_dim_idx, None, None, None, True,
                                  kv_heads)

    return q, k, v, back


def deepspeed_ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group,
                                scatter_idx: int, gather_idx: int, batch_dim_idx: int, local_attention: Any,
                                *args: Any, **kwargs: Any) -> torch.Tensor:
    """`deepspeed_exchange`, the local attention, and the way back (the key's head count as the
    key/value group count)."""
    q, k, v, back = deepspeed_exchange(query, key, value, group, scatter_idx, gather_idx, batch_dim_idx)
    return back(local_attention(q, k, v, *args, **kwargs))


def _rotary_pair(rotary_pos_emb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSpeed's `rotary_pos_emb`: None, or (cos, sin), 4-D tensors it permutes (1, 0, 2, 3)."""
    if rotary_pos_emb is None:
        return None
    if (not isinstance(rotary_pos_emb, (tuple, list)) or len(rotary_pos_emb) != 2
            or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in rotary_pos_emb)):
        raise TypeError("DistributedAttention.forward(q, k, v, batch_dim_idx, rotary_pos_emb, *args): rotary_pos_emb "
                        "is DeepSpeed's (cos, sin) pair of 4-D tensors or None, got "
                        f"{type(rotary_pos_emb).__name__}; pass the local attention's own arguments after it "
                        "(rotary_pos_emb=None first) or by keyword")
    return rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's rotary embedding (`deepspeed.sequence.layer.apply_rotary_pos_emb`): the first
    `freqs_cos.shape[-1]` features of `t` rotated in halves, `t * cos + rotate_half(t) * sin` with
    `rotate_half(x) = [-x2, x1]` (x1, x2 the two halves), the rest of `t` unchanged."""
    width = freqs_cos.shape[-1]
    rotated, kept = t[..., :width], t[..., width:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * freqs_cos + torch.cat((-second, first), dim=-1) * freqs_sin
    return rotated if kept.shape[-1] == 0 else torch.cat((rotated, kept), dim=-1)


class DistributedAttention(torch.nn.Module):
    """DeepSpeed-Ulysses attention around `local_attention(q, k, v, *args, **kwargs)`."""

    def __init__(self, local_attention: Any, sequence_process_group: Group | None, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None) -> None:
        """`sp_stream` is DeepSpeed's CUDA stream for overlapping the k/v all-to-alls; accepted for its
        signature, unused (the all-to-alls run in order on the current stream). `num_kv_heads` is
        DeepSpeed's: the key/value head count (grouped-query attention) the heads are dealt by when
        the forward has `batch_dim_idx`, so that every query head lands on the rank holding its
        key/value head; without it, the key's head count of each forward."""
        super().__init__()
        if scatter_idx == gather_idx:
            raise SequenceParallelError(f"scatter_idx and gather_idx are both {scatter_idx}: scatter_idx is the heads "
                                        "dimension and gather_idx the sequence dimension of q, k and v")
        if num_kv_heads is not None and (not isinstance(num_kv_heads, int) or num_kv_heads < 1):
            raise ValueError(f"num_kv_heads is the number of key/value heads (a positive int) or None, got "
                             f"{num_kv_heads!r}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads

    def _settings(self) -> EngineSequence | None:
        """The group and method to use, None to run the local attention alone."""
        if self.spg is not None:
            return EngineSequence(self.spg, "ulysses", SequenceLayout(comm.get_rank(self.spg),
                                                                      comm.get_world_size(self.spg)))
        settings = _ENGINE.get(self)
        return settings if settings is not None and settings.layout.size > 1 else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        """q, k, v hold this rank's slice of the sequence for every head; the result too.
        `batch_dim_idx` is DeepSpeed's argument: given (0 or 1), the layout comes from it as in
        DeepSpeed ([batch, seq, heads, head_dim] or [seq, batch, heads, head_dim]); without it,
        `gather_idx` is the sequence dimension and `scatter_idx` the heads'. `rotary_pos_emb` is
        DeepSpeed's too: a (cos, sin) pair of 4-D tensors, permuted (1, 0, 2, 3) and applied to q
        and k after the exchange, over the whole sequence (`apply_rotary_pos_emb`). Further
        arguments go to the local attention."""
        if batch_dim_idx is not None and (not isinstance(batch_dim_idx, int) or batch_dim_idx not in (0, 1)):
            raise TypeError(f"DistributedAttention.forward(q, k, v, batch_dim_idx, ...): batch_dim_idx is 0 "
                            f"([batch, seq, heads, head_dim]), 1 ([seq, batch, heads, head_dim]) or None, got "
                            f"{batch_dim_idx!r}; pass the local attention's own arguments after rotary_pos_emb or "
                            "by keyword")
        rotary = _rotary_pair(rotary_pos_emb)
        settings = self._settings()
        if settings is None:
            return self.local_attn(*_rotate(query, key, rotary), value, *args, **kwargs)
        # (sequence dim, heads dim)
        dims = ((1 - batch_dim_idx, head_exchange.HEADS_DIM) if batch_dim_idx is not None
                else (self.gather_idx % query.dim(), self.scatter_idx % query.dim()))
        if not settings.shapes_agreed:  # [Note: sequence shape agreement] in zerodist/sequence/agreement.py
            agree_attention_shapes(query, key, value, settings.group, "DistributedAttention", dims[::-1])
        if batch_dim_idx is not None and query.dim() != 4:  # the shapes are every rank's: refused alike
            raise SequenceParallelError(f"DistributedAttention(q, k, v, batch_dim_idx={batch_dim_idx}): q is "
                                        f"{tuple(query.shape)}; DeepSpeed's layout is 4-D [batch, seq, heads, "
                                        "head_dim] (batch_dim_idx=0) or [seq, batch, heads, head_dim] (1)")
        if settings.method == "ring":
            if rotary is not None:
                raise SequenceParallelError("DistributedAttention(rotary_pos_emb=...) under the ring method: the ring "
                                            "never gathers the whole sequence; apply the rotary embedding to q and k "
                                            "before the attention, at each rank's own positions")
            return self._ring(query, key, value, settings, dims)
        if batch_dim_idx is not None:
            q, k, v, back = deepspeed_exchange(query, key, value, settings.group, self.scatter_idx, self.gather_idx,
                                               batch_dim_idx, self.num_kv_heads)
        else:
            q, k, v, back = layout_exchange(query, key, value, settings.group, self.scatter_idx, self.gather_idx)
        return back(self.local_attn(*_rotate(q, k, rotary), v, *args, **kwargs))

    def _ring(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, settings: EngineSequence,
              dims: tuple[int, int]) -> torch.Tensor:
        # the ring works on [..., seq, heads, head_dim]: move this layout's (seq, heads) there and back
        q, k, v = (t.movedim(dims, (-3, -2)) for t in (query, key, value))
        out = ring_attention(q, k, v, settings.group, settings.layout, causal=settings.causal)
        return out.movedim((-3, -2), dims)


def _rotate(query: torch.Tensor, key: torch.Tensor,
            rotary: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if rotary is None:
        return query, key
    return apply_rotary_pos_emb(query, *rotary), apply_rotary_pos_emb(key, *rotary)
