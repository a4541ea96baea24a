"""The typed view of one engine's ZeRO state that `zerodist.checkpoint` and `zerodist.debug` take.

Those layers sit below the engine and must not reach into it: they receive a `ZeroState` (the
module, its flat groups, the reducer and sharded optimizer, the sharding policy, the topology
and the precision policy) and, for the engine's own resumable state (step counters, scheduler,
loss scaler, RNG, data position), any object with `training_state_dict()` /
`load_training_state_dict()` (`Resumable`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from zerodist.comm.topology import Topology
from zerodist.precision import PrecisionPolicy
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.hierarchy import describe_links
from zerodist.zero.optimizer import ZeroOptimizer
from zerodist.zero.policy import ShardingPolicy
from zerodist.zero.reducer import GradReducer
from zerodist.zero.registry import GatheredParameters
from zerodist.zero.runtime import UnitRuntime
from zerodist.zero.schedule import DefaultSchedule
from zerodist.zero.units import Unit


class Resumable(Protocol):
    """The engine's resumable training state: a dict with (at least) `global_steps`,
    `micro_steps`, `skipped_steps`, `gradient_accumulation_steps`, `loss_scaler`, `lr_scheduler`,
    `rng` and `data`; loading takes the same keys, each optional but the counters."""

    def training_state_dict(self) -> dict[str, Any]: ...

    def load_training_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass(frozen=True)
class ZeroState:
    """One engine's ZeRO state, typed."""

    module: torch.nn.Module
    groups: list[FlatParamGroup]
    reducer: GradReducer
    optimizer: ZeroOptimizer
    sharding: ShardingPolicy
    topology: Topology
    precision: PrecisionPolicy
    # The verbs that gather, free and reduce (runtime.py), and the hooks that call them by default.
    runtime: UnitRuntime
    schedule: DefaultSchedule
    # Stage 3: the groups of parameters nothing trains, sharded and gathered with their units but in no
    # reducer or optimizer ([Note: frozen parameters at stage 3] in apply.py).
    frozen_groups: list[FlatParamGroup] = dataclasses.field(default_factory=list)

    @property
    def units(self) -> tuple[Unit, ...]:
        """Stage 3's gathered-together modules, in unit order (empty when no parameter is sharded)."""
        return tuple(self.runtime.units) if self.runtime.shards_parameters else ()

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.inner

    def written_groups(self) -> list[FlatParamGroup]:
        """The groups whose shards this rank writes to a checkpoint: every domain group once, so not
        the copies replicated over axes the domain does not reduce over (`counts_in_norm`)."""
        return [g for g in self.groups if g.domain_group.counts_in_norm]

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state on this rank: parameters, gradients, optimizer (master + states)."""
        params = sum(g.state_bytes()["params"] for g in [*self.groups, *self.frozen_groups])
        grads = sum(g.state_bytes()["grads"] for g in self.groups)
        optimizer = self.optimizer.state_bytes()
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}

    def padded_num_params(self) -> int:
        """Ψ as laid out: every bucket padded to a multiple of N x 64 elements."""
        return sum(g.layout.total_numel for g in self.groups)

    # ------------------------------------------------------------------ the part state surface (comm/parts.py)
    def logical_state_dict(self) -> dict[str, torch.Tensor]:
        """The part's `state_dict()` with every parameter whole (gathered at stage 3), cloned;
        collective."""
        self.runtime.finish_gathers()
        with GatheredParameters(list(self.module.parameters()), enabled=bool(self.units)):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state  # ZeRO renames and reshapes nothing ([Note: logical names] in comm/domains.py)

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def load_logical_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole `state_dict()` (every rank the same) into the flat buffers, shards and master
        weights; collective."""
        self.runtime.finish_gathers(release=True)
        with GatheredParameters(list(self.module.parameters()), modifier_rank=0), torch.no_grad():
            self.module.load_state_dict(state)

    def report(self) -> list[str]:
        stage = self.sharding.stage
        lines = [f"ZeRO stage {stage}: {len(self.groups)} flat group(s), {len(self.reducer.order)} bucket(s)"]
        if self.frozen_groups:
            frozen = sum(len(g.params) for g in self.frozen_groups)
            lines[0] += f"; {frozen} frozen parameter(s) sharded in {len(self.frozen_groups)} group(s) of their own"
        if self.units:
            lines.append(f"{len(self.units)} unit(s) gathered around their use, {len(self.runtime.kept)} "
                         "kept from forward to backward")
        if self.groups:
            lines += describe_links(self.topology, self.groups[0].domain_group)
        return lines

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self.schedule.remove_hooks()

    def param_facts(self) -> dict[str, dict[str, Any]]:
        """Logical name -> {"shape", "placement"} of this rank's trained parameters."""
        facts = {}
        for group in self.groups:
            for record in group.records:
                facts[record.name] = {"shape": list(record.shape), "placement": record.placement_json()}
        return facts


def zero_state_of(obj: Any) -> ZeroState | None:
    """`obj`'s ZeRO state: `obj` itself when it is one, an engine's `zero_state`, None otherwise
    (a plain module)."""
    if isinstance(obj, ZeroState):
        return obj
    state = getattr(obj, "zero_state", None)
    return state if isinstance(state, ZeroState) else None
