"""Top-k gating with capacity: which expert each token goes to, in which slot, with what weight.

Pure tensor code, no processes: `route(...)` turns fp32 logits `[S, E]` into a `Routing`. The
formulas are DeepSpeed's (`deepspeed/moe/sharded_moe.py`: `top1gating`, `top2gating`,
`topkgating`), with the weak spots fixed:

- capacity `C = max(ceil(k * cf * S / E), min_capacity)`, then clamped to `S` (DeepSpeed can ask
  `topk` for more rows than there are tokens, #5353);
- every tie is broken by token position (and between experts by expert index), never by
  `torch.topk`'s unspecified order: see [Note: ties];
- random choices (RTS, Jitter, RSample, top-2 sampling) are drawn from a generator keyed by
  (seed, layer, batch shard, step, call), not by rank: see [Note: routing randomness];
- the gate runs in fp32 whatever the model's dtype.

[Note: ties] Expert choice: `argmax` and the stable sort used for top-k return the lowest expert
index among equal gates. Capacity: the routes to one expert are ranked in an order that is
total (a stable sort, equal keys keep token order), and the first C are kept:
- top-1 without RTS, top-k `position`: token order;
- top-2: all first choices in token order, then all second choices (DeepSpeed's layout);
- top-1 with RTS: by a uniform draw, highest first; top-k `probs`: by gate, highest first.
Slots inside the capacity buffer are then given in token order (top-2: the rank itself).

[Note: routing randomness] DeepSpeed draws from the device's global generator, so the same tokens
route differently on another rank or at another expert-parallel size. Here the generator is
seeded from `RoutingKey` = (seed, layer, shard, step, call): `shard` is the batch shard the
tokens come from (`Topology.batch_rank`), `step` the optimizer step (set by the engine),
`call` the number of forwards since the step was set. A one-process reference that sets the
same key routes a shard's tokens exactly as the rank that owns the shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.nn.functional as F

DROP_POLICIES = ("probs", "position")
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPSILON = 1e-2


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: `max(ceil(k * cf * S / E), min_capacity)`, never more than `S`.

    The product is rounded to 9 decimals before `ceil`, so a factor written as a decimal does
    not gain a slot from float noise (1.1 * 10 / 11 is 1.0000000000000002 in float64)."""
    wanted = math.ceil(round(k * capacity_factor * num_tokens / num_experts, 9))
    return min(max(wanted, min_capacity), num_tokens)


@dataclasses.dataclass
class RoutingKey:
    """What the gate's random draws are keyed by; see [Note: routing randomness]."""

    seed: int = 0
    layer: int = 0
    shard: int = 0
    step: int = 0
    call: int = 0

    def generator(self) -> torch.Generator:
        digest = hashlib.blake2b(repr((self.seed, self.layer, self.shard, self.step, self.call)).encode(), digest_size=8)
        return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") & (2**63 - 1))


class Draws:
    """Random tensors for one gate call, drawn on the CPU (so every device type agrees) in a
    fixed order from one keyed generator."""

    def __init__(self, generator: torch.Generator | None, device: torch.device):
        self._generator = generator
        self._device = device

    def uniform(self, *shape: int) -> torch.Tensor:
        if self._generator is None:
            raise RuntimeError("this gate configuration makes no random draws")
        return torch.rand(shape, generator=self._generator, dtype=torch.float32).to(self._device)

    def gumbel(self, *shape: int) -> torch.Tensor:
        tiny = torch.finfo(torch.float32).tiny
        uniform = self.uniform(*shape).clamp_(min=tiny, max=1.0 - torch.finfo(torch.float32).eps)
        return -torch.log(-torch.log(uniform))


@dataclasses.dataclass
class Routing:
    """The gate's decision for S tokens and k choices each (row s, column j = token s's j-th choice).

    `expert`, `slot` [S, k] int64; `kept` [S, k] bool (False: dropped by capacity, or an unused
    token); `weight` [S, k] fp32 combine weight, differentiable, 0 where not kept; `slot` is the
    row in the expert's capacity buffer (capacity mode only, 0 where not kept); `l_aux` the
    load-balancing loss over these S tokens; `exp_counts` [E] int64 routes per expert before
    drops; `capacity` C, or None in dropless mode."""

    expert: torch.Tensor
    slot: torch.Tensor
    kept: torch.Tensor
    weight: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    capacity: int | None

    @property
    def num_dropped(self) -> int:
        """Routes lost to capacity (unused tokens are not routes)."""
        return int(self.exp_counts.sum()) - int(self.kept.sum())


@dataclasses.dataclass(frozen=True)
class GateSettings:
    """How one gate routes; the values of DeepSpeed's `TopKGate` arguments."""

    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    drop_policy: str = "probs"
    load_balance_coeff: float | None = None  # aux-loss-free balancing: bias step size, None = off

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k must be an int between 1 and num_experts ({self.num_experts}), got {self.k!r}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"min_capacity must be an int >= 0, got {self.min_capacity!r}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {self.noisy_gate_policy!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ValueError(f"load_balance_coeff must be > 0 (or None to turn it off), got {self.load_balance_coeff!r}")

    def uses_draws(self, training: bool) -> bool:
        noisy = training and self.noisy_gate_policy in ("Jitter", "RSample")
        rts = self.k == 1 and self.use_rts and self.drop_tokens
        return noisy or rts or (self.k == 2 and self.top2_2nd_expert_sampling)


def route(logits: torch.Tensor, settings: GateSettings, *, training: bool, draws: Draws,
          used_token: torch.Tensor | None = None, selection_bias: torch.Tensor | None = None) -> Routing:
    """Route S tokens given their fp32 gate logits `[S, E]` (see the module doc for the rules).

    `selection_bias` [E] (aux-loss-free balancing) is added to the gate probabilities when
    choosing experts only: the combine weights and l_aux use the unbiased gates."""
    num_tokens, num_experts = logits.shape
    if num_experts != settings.num_experts:
        raise ValueError(f"gate logits have {num_experts} experts, the gate was built for {settings.num_experts}")
    gates = F.softmax(logits, dim=1)
    expert = _choose_experts(logits, gates, settings, training, draws, selection_bias)
    used = _used_mask(used_token, num_tokens, logits.device)
    routed = used[:, None].expand_as(expert)
    exp_counts = torch.bincount(expert[routed], minlength=num_experts).to(torch.int64)
    l_aux = _l_aux(gates, expert, routed, settings.k)
    factor = settings.capacity_factor if training else settings.eval_capacity_factor
    if settings.drop_tokens:
        cap = capacity(num_tokens, num_experts, settings.k, factor, settings.min_capacity)
        kept, slot = _apply_capacity(expert, routed, gates, cap, settings, draws)
    else:
        cap, kept, slot = None, routed.clone(), torch.zeros_like(expert)
    chosen_gate = gates.gather(1, expert)
    weight = chosen_gate * kept
    if settings.k > 1:  # top-2 and top-k renormalise over the kept routes; top-1 keeps the raw prob
        weight = weight / weight.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weight.dtype).eps)
    return Routing(expert, slot, kept, weight, l_aux, exp_counts.detach(), cap)


def _used_mask(used_token: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    if used_token is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    used = used_token.reshape(-1)
    if used.numel() != num_tokens:
        raise ValueError(f"used_token has {used.numel()} entries but the layer got {num_tokens} tokens")
    return used != 0


def _choose_experts(logits: torch.Tensor, gates: torch.Tensor, settings: GateSettings, training: bool,
                    draws: Draws, bias: torch.Tensor | None) -> torch.Tensor:
    """[S, k] expert indices, choice order; ties to the lowest expert index. With a selection
    bias, noisy scores are turned into probabilities first, so the bias adds to a probability."""
    num_tokens, num_experts = logits.shape

    def biased(scores: torch.Tensor, are_probabilities: bool) -> torch.Tensor:
        if bias is None:
            return scores
        return (scores if are_probabilities else F.softmax(scores, dim=1)) + bias

    if settings.k == 1:
        if training and settings.noisy_gate_policy == "RSample":
            return torch.argmax(biased(logits + draws.gumbel(num_tokens, num_experts), False), dim=1, keepdim=True)
        return torch.argmax(biased(gates, True), dim=1, keepdim=True)
    if settings.k == 2:
        first = torch.argmax(biased(gates, True), dim=1, keepdim=True)
        scores = logits + draws.gumbel(num_tokens, num_experts) if settings.top2_2nd_expert_sampling else logits
        second = torch.argmax(biased(scores, False).scatter(1, first, float("-inf")), dim=1, keepdim=True)
        return torch.cat([first, second], dim=1)
    order = torch.sort(biased(gates, True), dim=1, descending=True, stable=True).indices
    return order[:, : settings.k].contiguous()


def _l_aux(gates: torch.Tensor, expert: torch.Tensor, routed: torch.Tensor, k: int) -> torch.Tensor:
    """DeepSpeed's load-balancing loss. me = mean gate per expert over all S tokens; ce = fraction
    of tokens per expert: top-1 and top-2 count the first choice only, giving E * sum(me * ce);
    top-k>2 counts all k choices, giving E * sum(me * ce) / k."""
    num_tokens, num_experts = gates.shape
    me = gates.mean(dim=0)
    counted = expert[:, :1] if k <= 2 else expert
    hot = F.one_hot(counted, num_experts).to(gates.dtype) * routed[:, : counted.shape[1], None]
    ce = hot.sum(dim=(0, 1)) / num_tokens
    scale = 1.0 if k <= 2 else 1.0 / k
    return torch.sum(me * ce) * num_experts * scale


def _rank_within_expert(expert_flat: torch.Tensor, valid: torch.Tensor, order: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For entries listed in `order` (a permutation), each valid entry's index among the valid
    entries of the same expert that come before it in that order; -1 for invalid entries."""
    in_order = expert_flat[order]
    hot = F.one_hot(in_order, num_experts) * valid[order, None]
    ranks_in_order = (torch.cumsum(hot, dim=0) - 1).gather(1, in_order[:, None]).squeeze(1)
    ranks = torch.empty_like(ranks_in_order)
    ranks[order] = ranks_in_order
    return torch.where(valid, ranks, torch.full_like(ranks, -1))


def _apply_capacity(expert: torch.Tensor, routed: torch.Tensor, gates: torch.Tensor, cap: int,
                    settings: GateSettings, draws: Draws) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, slot) [S, k]: which routes fit in `cap` slots per expert, ranked per [Note: ties]."""
    num_tokens, k = expert.shape
    num_experts = gates.shape[1]
    # Entries are numbered choice-major (j * S + s), so the identity order is "first choices in
    # token order, then second choices ..." and a stable sort keeps that order among equal keys.
    expert_flat, routed_flat = expert.t().reshape(-1), routed.t().reshape(-1)
    by_choice = torch.arange(expert_flat.numel(), device=expert.device)
    by_token = (by_choice % num_tokens) * k + by_choice // num_tokens
    by_token = torch.argsort(by_token)  # entry indices sorted by (token, choice)
    if k == 1 and settings.use_rts:
        priority = draws.uniform(num_tokens, num_experts).gather(1, expert).t().reshape(-1)
    elif k > 2 and settings.drop_policy == "probs":
        priority = gates.detach().gather(1, expert).t().reshape(-1)
    else:
        priority = None
    if priority is None:
        # top-2: slot = rank, second choices after all first choices (DeepSpeed's layout).
        order = by_choice if k == 2 else by_token
        rank = _rank_within_expert(expert_flat, routed_flat, order, num_experts)
        kept_flat = (rank >= 0) & (rank < cap)
        slot_flat = rank
    else:
        # Priority first (stable: ties keep the (token, choice) order), then slots by token order.
        order = by_token[torch.sort(priority[by_token], descending=True, stable=True).indices]
        rank = _rank_within_expert(expert_flat, routed_flat, order, num_experts)
        kept_flat = (rank >= 0) & (rank < cap)
        slot_flat = _rank_within_expert(expert_flat, kept_flat, by_token, num_experts)
    kept = kept_flat.reshape(k, num_tokens).t()
    slot = torch.where(kept_flat, slot_flat, torch.zeros_like(slot_flat)).reshape(k, num_tokens).t()
    return kept.contiguous(), slot.contiguous()


class TopKGate(torch.nn.Module):
    expert_bias: torch.Tensor  # buffers registered in __init__ (with load balancing only)
    tokens_per_expert: torch.Tensor
    """DeepSpeed's `TopKGate`: a bias-free linear map to E logits (`wg`, a dense parameter), run
    in fp32, then `route`. Returns a `Routing`."""

    def __init__(self, model_dim: int, settings: GateSettings) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, settings.num_experts, bias=False)
        self.settings = settings
        self.routing_key = RoutingKey()
        if settings.load_balance_coeff is not None:
            # Aux-loss-free balancing (DeepSeek-V3): a selection-only bias, saved with the model, and
            # this rank's routes per expert since the last update (not saved: updates run at step ends).
            self.register_buffer("expert_bias", torch.zeros(settings.num_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(settings.num_experts), persistent=False)

    @property
    def k(self) -> int:
        return self.settings.k

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        settings = self.settings
        generator = self.routing_key.generator() if settings.uses_draws(self.training) else None
        self.routing_key.call += 1
        draws = Draws(generator, tokens.device)
        tokens_fp32 = tokens.float()
        if self.training and settings.noisy_gate_policy == "Jitter":
            low = 1.0 - JITTER_EPSILON
            tokens_fp32 = tokens_fp32 * (low + 2 * JITTER_EPSILON * draws.uniform(*tokens_fp32.shape))
        logits = F.linear(tokens_fp32, self.wg.weight.float())
        bias = getattr(self, "expert_bias", None)
        routing = route(logits, settings, training=self.training, draws=draws, used_token=used_token,
                        selection_bias=None if bias is None else bias.float())
        if bias is not None and self.training:
            self.tokens_per_expert += routing.exp_counts.to(self.tokens_per_expert.dtype)
        return routing
