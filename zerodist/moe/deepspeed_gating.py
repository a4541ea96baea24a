"""DeepSpeed's gating functions, by name and output format (``deepspeed.moe.sharded_moe``).

    l_aux, combine_weights, dispatch_mask, exp_counts = top1gating(logits, capacity_factor, min_capacity)
    l_aux, capacity, num_experts, indices, locations, gates, exp_counts = top2gating(..., sparse_routes=True)

These are the free functions DeepSpeed code and tests call on their own; zerodist's `MoE` layer
routes with `zerodist.moe.gating.route` (ties by position, keyed randomness, capacity clamped to
the token count). Here every choice is DeepSpeed's, so that the same logits give DeepSpeed's masks:

- capacity `max(ceil(S / E * cf * k), min_capacity)` in fp32 tensor arithmetic, *not* clamped to
  S (it sizes the dispatch buffer; only the selection over tokens is bounded by S);
- top-1 keeps the capacity's routes per expert by `torch.topk` over tokens of the route mask
  (times a uniform draw from torch's global generator with `use_rts`), top-2 by position with the
  second choices after all first choices, top-k by gate ('probs', `torch.topk`) or position;
- `drop_tokens=False`: the capacity is the largest expert load, made the maximum over `ep_group`
  by one `all_reduce(MAX)` when that group has more than one rank (no collective otherwise);
- random draws (RSample, RTS, the 2nd-expert Gumbel sample, Jitter) come from torch's global generator
  through DeepSpeed's `torch.distributions` samplers, so the same seed gives DeepSpeed's noise.

The dense format is `combine_weights` [S, E, C] (the route's weight at its expert and slot) and
`dispatch_mask = combine_weights.bool()`; the sparse one (`sparse_routes=True`) gives per route
(choice-major [k, S]) the expert (-1 where capacity dropped it), the slot and the weight.
`_route_slots`, `_sparse_encode` and `_sparse_decode` turn routes into a buffer and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from zerodist import comm as dist

TUTEL_INSTALLED = False


# DeepSpeed's per-device samplers (`torch.distributions`' `rsample`, built once per device), so that the same
# seed gives DeepSpeed's noise: Gumbel draws u in [tiny, 1 - eps) and takes -log(-log(u)); Uniform(a, b) takes
# a + rand * (b - a). The jitter's is keyed by its epsilon too (DeepSpeed's keeps the first epsilon per device).
Sampler = Callable[[torch.Size | tuple[int, ...]], torch.Tensor]
uniform_map: dict[tuple[torch.device, float], Sampler] = {}
gumbel_map: dict[torch.device, Sampler] = {}
exp_selection_uniform_map: dict[torch.device, Sampler] = {}


def _uniform(device: torch.device, low: float, high: float) -> Sampler:
    return torch.distributions.uniform.Uniform(low=torch.tensor(low, device=device),
                                               high=torch.tensor(high, device=device)).rsample


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise from torch's global generator, as DeepSpeed draws it
    (`torch.distributions.gumbel.Gumbel(0, 1).rsample`)."""
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                                   torch.tensor(1.0, device=device)).rsample
        gumbel_map[device] = gumbel
    return gumbel(torch.Size(shape))


def multiplicative_jitter(x: torch.Tensor, device: torch.device, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times a uniform draw in [1 - epsilon, 1 + epsilon) (the 'Jitter' noisy-gate policy), as DeepSpeed
    draws it (`torch.distributions.uniform.Uniform(1 - epsilon, 1 + epsilon).rsample`)."""
    if epsilon == 0:
        return x
    uniform = uniform_map.get((device, epsilon))
    if uniform is None:
        uniform = uniform_map[(device, epsilon)] = _uniform(device, 1.0 - epsilon, 1.0 + epsilon)
    return x * uniform(x.shape)


def _exp_selection_uniform(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """top-1's Random Token Selection draw, DeepSpeed's `Uniform(0, 1).rsample`."""
    uniform = exp_selection_uniform_map.get(device)
    if uniform is None:
        uniform = exp_selection_uniform_map[device] = _uniform(device, 0.0, 1.0)
    return uniform(shape)


def _capacity(gates: torch.Tensor, capacity_factor: torch.Tensor, min_capacity: torch.Tensor) -> torch.Tensor:
    """Slots per expert (0-d int64): `ceil(S / E * capacity_factor)`, at least `min_capacity`."""
    num_tokens, num_experts = gates.shape
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    return torch.maximum(capacity, min_capacity.to(torch.int64))


def _largest_load(exp_counts: torch.Tensor, ep_group: Any) -> torch.Tensor:
    """drop_tokens=False: the capacity is the largest expert load, the maximum over `ep_group`."""
    capacity = torch.max(exp_counts)
    if ep_group is not None and dist.get_world_size(group=ep_group) > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    return capacity


def _one_hot_slots(locations: torch.Tensor, capacity: torch.Tensor | int) -> torch.Tensor:
    return F.one_hot(locations.long(), num_classes=int(capacity)).float()


def _dense(gates_se: list[torch.Tensor], locations_s: list[torch.Tensor], capacity: torch.Tensor | int) -> torch.Tensor:
    """combine_weights [S, E, C]: each choice's [S, E] weights placed at its slot."""
    return sum((g[:, :, None] * _one_hot_slots(loc, capacity)[:, None, :] for g, loc in zip(gates_se, locations_s)),
               torch.zeros(()))


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's top-1 gating: (l_aux, combine_weights, dispatch_mask, exp_counts), or with
    `sparse_routes` (l_aux, capacity, E, indices [1, S], locations [1, S], gates [1, S], exp_counts)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))
    scores = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    chosen = torch.argmax(scores, dim=1)
    mask = F.one_hot(chosen, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = torch.clamp(_largest_load(exp_counts, ep_group), max=num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if num_tokens < min_capacity:
        raise ValueError(f"top1gating: {num_tokens} tokens is fewer than min_capacity={min_capacity}; set "
                         "min_capacity to 0 or feed more tokens (DeepSpeed asserts the same)")
    priority = mask * _exp_selection_uniform(mask.shape, logits.device) if use_rts else mask
    keep = torch.topk(priority, k=int(min(int(capacity), num_tokens)), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    if sparse_routes:
        indices = torch.where(mask.sum(dim=1) > 0, chosen, torch.full_like(chosen, -1))
        weights = (gates * mask).sum(dim=1)
        return (l_aux, capacity, num_experts, indices.to(torch.int32)[None], locations.to(torch.int32)[None],
                weights[None], exp_counts)
    combine_weights = _dense([gates * mask.float()], [locations], capacity)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's top-2 gating (GShard): the second expert is the argmax of the logits (plus
    Gumbel noise with `top2_2nd_expert_sampling`) without the first; slots by position, second
    choices after all first choices; the two weights renormalised over the kept routes."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    scores = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second = torch.argmax(scores.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = _largest_load(exp_counts, ep_group)
    slots = [torch.sum(locations1 * mask1, dim=1), torch.sum(locations2 * mask2, dim=1)]
    weights = [(gates * mask1.float()).sum(dim=1), (gates * mask2.float()).sum(dim=1)]
    denominator = torch.clamp(weights[0] + weights[1], min=torch.finfo(gates.dtype).eps)
    weights = [w / denominator for w in weights]
    if sparse_routes:
        indices = [torch.where(m.any(dim=1), i, torch.full_like(i, -1)) for m, i in ((mask1, first), (mask2, second))]
        return (l_aux, capacity, num_experts, torch.stack(indices).to(torch.int32),
                torch.stack(slots).to(torch.int32), torch.stack(weights), exp_counts)
    combine_weights = _dense([weights[0][:, None] * mask1.float(), weights[1][:, None] * mask2.float()], slots, capacity)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's top-k gating: the k largest gates (`torch.topk`); with capacity, each expert
    keeps its `capacity` highest-gate routes ('probs') or its first ones ('position'); weights
    renormalised over the kept routes."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if not drop_tokens:
        capacity = _largest_load(exp_counts, ep_group)
    else:
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":
            routed_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            best = torch.topk(routed_gates, k=int(min(int(capacity), num_tokens)), dim=0, sorted=False).indices
            mask &= torch.zeros_like(mask).scatter_(0, best, True)
        else:
            mask &= (torch.cumsum(mask, dim=0) - 1) < capacity
    locations = torch.cumsum(mask, dim=0) - 1
    kept_gates = gates * mask
    kept_gates = kept_gates / torch.clamp(kept_gates.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    if sparse_routes:
        kept = mask.gather(1, top_idx)
        routes = (torch.where(kept, top_idx, torch.full_like(top_idx, -1)), locations.gather(1, top_idx) * kept,
                  kept_gates.gather(1, top_idx))
        return (l_aux, capacity, num_experts, routes[0].t().contiguous().to(torch.int32),
                routes[1].t().contiguous().to(torch.int32), routes[2].t().contiguous(), exp_counts)
    combine_weights = kept_gates[:, :, None] * _one_hot_slots(locations * mask, capacity)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Each route's row in the flat [E * C] buffer; dropped routes (expert -1) point at row E * C."""
    slots = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slots, torch.full_like(slots, num_experts * capacity))


def _sparse_encode(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The [E, C, M] dispatch buffer: each slot holds its route's token, unused slots zeros."""
    num_tokens, hidden = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    source[slots.reshape(-1)] = torch.arange(num_tokens, device=tokens.device).repeat(slots.shape[0])
    padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
    return padded[source[:-1]].view(num_experts, capacity, hidden)


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's routes' outputs [E * C, M] times their weights, summed in fp32 (the gates')."""
    hidden = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, hidden)])
    routed = padded[slots.reshape(-1)].view(slots.shape[0], num_tokens, hidden)
    return (routed * gates[:, :, None]).sum(dim=0).to(expert_output.dtype)
