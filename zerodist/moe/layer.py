"""DeepSpeed's MoE layer, by import path and signature: `zerodist.moe.layer.MoE`.

    moe = MoE(hidden_size, expert, num_experts=8, ep_size=2, k=2)
    output, l_aux, exp_counts = moe(hidden_states)

`output` has the input's shape; `l_aux` is the load-balancing loss over this rank's tokens (add
`coef * l_aux` to the loss yourself, as with DeepSpeed); `exp_counts` [E] counts the routes per
expert before capacity drops.

With `ep_size > 1` the layer needs the expert-parallel group of a `Topology(expert=ep_size)`:
`zerodist.initialize` gives it to every MoE layer of the model, or call
`moe.set_topology(topology)` to use the layer on its own. Rank r of an expert group owns the
global experts `r * E_local ... (r + 1) * E_local - 1` (`E_local = num_experts // ep_size`).
"""

from __future__ import annotations

import dataclasses
import datetime
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from zerodist import comm
from zerodist.comm import Group
from zerodist.comm.domains import declare_expert_parallel, declare_logical_offset
from zerodist.comm.init import resolve_timeout
from zerodist.moe import dispatch
from zerodist.moe.experts import Experts
from zerodist.moe.gating import GateSettings, Routing, TopKGate
from zerodist.utils import get_logger

logger = get_logger(__name__)

_DEFAULT_SHAPE_CHECK_TIMEOUT_S = 300.0


class MoEShapeMismatchError(RuntimeError):
    """Ranks of one expert group would exchange tokens of different shapes (token count, capacity,
    hidden size or dtype); raised on every rank of the group before any all-to-all is issued."""


@dataclasses.dataclass(frozen=True)
class ExpertParallelContext:
    """What a layer needs from the topology: its expert group, its index in it, and the group's
    global ranks (to read their values out of a world-wide exchange)."""

    group: Group
    batch_group: Group  # over ("data", "expert"): every batch shard, for the balancing counts
    expert_rank: int
    expert_ranks: tuple[int, ...]
    world_rank: int


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    """The last forward's load: routes per expert (before drops), routes dropped, and the elements
    the forward all-to-alls moved (payload, this rank)."""

    exp_counts: tuple[int, ...]
    num_routes: int
    num_dropped: int
    capacity: int | None
    all_to_all_elements: int

    @property
    def drop_fraction(self) -> float:
        return self.num_dropped / self.num_routes if self.num_routes else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean routes per expert (1.0 is perfect balance)."""
        mean = sum(self.exp_counts) / len(self.exp_counts)
        return max(self.exp_counts) / mean if mean else 0.0


# Process groups cannot be deep-copied or pickled, so a layer's context lives beside it.
_CONTEXTS: weakref.WeakKeyDictionary[nn.Module, ExpertParallelContext] = weakref.WeakKeyDictionary()


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (DeepSpeed's `MOELayer`, as `MoE.deepspeed_moe`)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.last_stats: RoutingStats | None = None
        self._shapes_agreed = False

    @property
    def num_experts(self) -> int:
        return self.ep_size * self.num_local_experts

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, hidden)
        context = self._context()
        routing = self.gate(tokens, used_token)
        if routing.capacity is not None:
            combined, moved = self._forward_capacity(tokens, routing, context)
        else:
            combined, moved = self._forward_dropless(tokens, routing, context)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        self.last_stats = RoutingStats(tuple(routing.exp_counts.tolist()), int(routing.exp_counts.sum()),
                                       routing.num_dropped, routing.capacity, moved)
        return combined.reshape(hidden_states.shape)

    def _context(self) -> ExpertParallelContext | None:
        if self.ep_size == 1:
            return None
        context = _CONTEXTS.get(self)
        if context is None:
            raise RuntimeError(
                f"this MoE layer has ep_size={self.ep_size} but no expert-parallel group: pass the model to "
                f"zerodist.initialize, or call moe.set_topology(Topology(expert={self.ep_size})) on every rank")
        return context

    def _forward_capacity(self, tokens: torch.Tensor, routing: Routing,
                          context: ExpertParallelContext | None) -> tuple[torch.Tensor, int]:
        plan = dispatch.plan_capacity(routing, self.num_experts)
        buffer = dispatch.dispatch_capacity(tokens, plan)  # [E, C, M]
        if context is not None:
            self._agree_on_shapes(context, tokens, plan.capacity)
            buffer = dispatch.all_to_all(context.group, buffer)
        hidden = tokens.shape[1]
        expert_input = buffer.reshape(self.ep_size, self.num_local_experts, plan.capacity, hidden)
        expert_output = self.experts(expert_input).reshape(self.num_experts, plan.capacity, hidden)
        if context is not None:
            expert_output = dispatch.all_to_all(context.group, expert_output)
        moved = 2 * buffer.numel() if context is not None else 0
        return dispatch.combine_capacity(expert_output, plan), moved

    def _forward_dropless(self, tokens: torch.Tensor, routing: Routing,
                          context: ExpertParallelContext | None) -> tuple[torch.Tensor, int]:
        group = None if context is None else context.group
        if context is not None:
            self._agree_on_shapes(context, tokens, None)
        plan = dispatch.plan_dropless(routing, self.num_experts, group, self.ep_size)
        rows = tokens[plan.send_token]
        if context is not None:
            rows = dispatch.all_to_all(group, rows, plan.output_splits, plan.input_splits)
        returned = self.experts.forward_rows(rows, plan.received_counts)
        moved = 0
        if context is not None:
            moved = rows.numel() + plan.send_token.numel() * tokens.shape[1]
            returned = dispatch.all_to_all(group, returned, plan.input_splits, plan.output_splits)
        return dispatch.combine_dropless(returned, plan), moved


    def _agree_on_shapes(self, context: ExpertParallelContext, tokens: torch.Tensor, capacity: int | None) -> None:
        """Agree on what the all-to-alls will carry before issuing them: a rank whose shapes differ
        would otherwise leave its peers waiting in the collective (DeepSpeed #6809, #5794).

        The first forward exchanges the whole signature through the world's store with a deadline
        (`zerodist.comm.exchange_with_deadline`): it cannot hang, even when a rank never reaches
        the layer. Later forwards only need what can change from batch to batch: in capacity mode
        the token count and capacity, gathered over the expert group in one fixed-size all_gather
        (a store round trip per layer cost ~60 ms per forward on gloo); dropless mode exchanges
        its counts anyway, and its splits follow from them."""
        if not self._shapes_agreed:
            mode = "dropless" if capacity is None else "capacity"
            signature = (mode, None if capacity is None else tokens.shape[0], capacity, tokens.shape[1], str(tokens.dtype))
            timeout = resolve_timeout(None)
            timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else _DEFAULT_SHAPE_CHECK_TIMEOUT_S
            # among the expert group only: a pipeline's other stages reach their layers at other times
            values = comm.exchange_with_deadline("moe-shapes", repr(signature), timeout_s, ranks=context.expert_ranks)
            _raise_if_different(dict(zip(context.expert_ranks, values)))
            self._shapes_agreed = True
            return
        if capacity is None:
            return
        mine = torch.tensor([tokens.shape[0], capacity], dtype=torch.int64, device=tokens.device)
        everyone = mine.new_empty(2 * self.ep_size)
        comm.all_gather(everyone, mine, group=context.group)
        pairs = everyone.view(self.ep_size, 2).tolist()
        _raise_if_different({rank: f"tokens {s}, capacity {c}" for rank, (s, c) in zip(context.expert_ranks, pairs)})


def _raise_if_different(values: dict[int, str]) -> None:
    if len(set(values.values())) > 1:
        listed = "; ".join(f"rank {rank}: {value}" for rank, value in values.items())
        raise MoEShapeMismatchError(
            "the ranks of an expert-parallel group disagree on what the MoE all-to-all carries: "
            f"{listed}. In capacity mode every rank of the group must feed the same number of tokens "
            "(drop the ragged last batch, or pad and pass used_token); drop_tokens=False accepts "
            "different token counts.")


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE` (same arguments, defaults and return values).

    Beyond DeepSpeed: `drop_policy` ('probs' or 'position', top-k>2 only, as DeepSpeed's
    `topkgating`); `load_balance_coeff` (aux-loss-free balancing: a selection-only bias
    `deepspeed_moe.gate.expert_bias`, moved by `coeff * sign(mean - count)` at each optimizer
    step from the routes counted over all batch shards, see `update_expert_bias`). `use_tutel=True` logs a fallback to the built-in dispatch;
    `enable_expert_tensor_parallelism=True` has no effect without a tensor-parallel axis (logged)
    and is refused with one (not implemented)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, drop_policy: str = "probs",
                 load_balance_coeff: float | None = None) -> None:
        super().__init__()
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size}), a positive int")
        settings = GateSettings(num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy,
                                drop_tokens, use_rts, top2_2nd_expert_sampling, drop_policy, load_balance_coeff)
        _log_options(settings, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, settings), experts, self.expert_group_name, ep_size,
                                      self.num_local_experts)
        declare_expert_parallel(self, ep_size)  # initialize's topology takes the expert degree from it
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # weighs the MoE and the dense MLP outputs

    def set_topology(self, topology: comm.Topology) -> None:
        """Use `topology`'s expert group (build the same Topology on every rank). Also sets the
        batch shard that keys this layer's random routing to `topology.batch_rank`."""
        if topology.size("expert") != self.ep_size:
            raise ValueError(f"this MoE layer has ep_size={self.ep_size} but the topology's expert degree is "
                             f"{topology.size('expert')}; build Topology(expert={self.ep_size})")
        if self.enable_expert_tensor_parallelism and topology.size("tensor") > 1:
            raise NotImplementedError("enable_expert_tensor_parallelism=True with a tensor-parallel axis is not "
                                      "implemented; set it to False (experts are then replicated over 'tensor')")
        expert_rank = topology.axis_rank("expert")
        _CONTEXTS[self.deepspeed_moe] = ExpertParallelContext(
            topology.group("expert"), topology.group(*topology.batch_axes), expert_rank,
            tuple(topology.ranks("expert")), topology.rank)
        # Checkpoints name local expert k as global expert expert_rank * E_local + k.
        declare_logical_offset(self.deepspeed_moe.experts.deepspeed_experts, expert_rank * self.num_local_experts)
        self.deepspeed_moe.gate.routing_key.shard = topology.batch_rank

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed builds its groups here; zerodist's come from the Topology that
        `zerodist.initialize` (or `set_topology`) gives the layer."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("zerodist's mesh is data-major (expert ranks are neighbours); "
                                      "use_data_before_expert_parallel_=True is not supported")
        logger.info("MoE.set_deepspeed_parallelism: nothing to do; zerodist.initialize gives MoE layers their group")

    def set_routing_key(self, *, seed: int | None = None, layer: int | None = None, shard: int | None = None,
                        step: int | None = None) -> None:
        """Set what this layer's random routing is keyed by (see [Note: routing randomness] in
        zerodist/moe/gating.py); setting `step` restarts the per-step call count."""
        key = self.deepspeed_moe.gate.routing_key
        for name, value in (("seed", seed), ("layer", layer), ("shard", shard), ("step", step)):
            if value is not None:
                setattr(key, name, int(value))
        if step is not None:
            key.call = 0

    @torch.no_grad()
    def update_expert_bias(self) -> torch.Tensor | None:
        """Aux-loss-free balancing step (collective over the batch shards when a topology is set):
        sum the routes per expert counted since the last update over every batch shard, then move
        each expert's selection bias by `coeff * sign(mean - count)` (overloaded experts down,
        underloaded up, balanced ones not at all) and restart the count. Returns the change, or
        None when balancing is off. `zerodist.initialize` runs it after each step's last forward."""
        gate = self.deepspeed_moe.gate
        if gate.settings.load_balance_coeff is None:
            return None
        counts = gate.tokens_per_expert.clone()
        context = _CONTEXTS.get(self.deepspeed_moe)
        if context is not None:
            comm.all_reduce(counts, group=context.batch_group)
        change = gate.settings.load_balance_coeff * torch.sign(counts.mean() - counts)
        gate.expert_bias.add_(change)
        gate.tokens_per_expert.zero_()
        return change

    def global_expert_ids(self) -> list[int]:
        """The global ids of this rank's local experts, local order."""
        context = _CONTEXTS.get(self.deepspeed_moe)
        expert_rank = 0 if context is None else context.expert_rank
        return [expert_rank * self.num_local_experts + local for local in range(self.num_local_experts)]

    @property
    def last_stats(self) -> RoutingStats | None:
        return self.deepspeed_moe.last_stats

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _log_options(settings: GateSettings, use_tutel: bool, enable_expert_tensor_parallelism: bool) -> None:
    if use_tutel:
        logger.warning("MoE(use_tutel=True): Tutel is not supported by zerodist; using the built-in dispatch "
                       "(same results)")
    if enable_expert_tensor_parallelism:
        logger.warning("MoE(enable_expert_tensor_parallelism=True): no effect without a tensor-parallel axis; "
                       "with one, set_topology refuses it (not implemented)")
    if settings.noisy_gate_policy == "RSample" and settings.k != 1:
        logger.warning("MoE(noisy_gate_policy='RSample') applies to top-1 gating only (as in DeepSpeed); "
                       "with k=%d it is ignored", settings.k)


def routing_lines(model: nn.Module) -> list[str]:
    """One line per MoE layer of `model` on this rank's last training forward: load per expert
    (routes before drops), imbalance (max / mean), drop fraction and the elements its forward
    all-to-alls moved. Local: no collective, so the engine's step log can print it on rank 0."""
    lines = []
    for name, module in model.named_modules():
        stats = module.last_stats if isinstance(module, MoE) else None
        if stats is None:
            continue
        lines.append(f"MoE '{name}': routes per expert {list(stats.exp_counts)}, imbalance {stats.imbalance:.2f}, "
                     f"dropped {stats.drop_fraction:.1%}, all-to-all {stats.all_to_all_elements:,} elements (rank 0)")
    return lines
