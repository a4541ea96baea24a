"""Checks that every rank runs the same units in the same order (sharded parameters).

[Note: unit order check] Stage 3 issues collectives from hooks, so ranks whose control flow
differs (a block run twice on one rank, an early exit) would pair different collectives and
hang (gloo aborts the process when the sizes differ). Before each batch of gathers (a hook's
own unit and the units it prefetches) every rank exchanges a fingerprint (what, which unit, how
many times, which batch) in one tiny all-gather; the first divergence in the gathers is therefore
always at a fingerprint exchange, which then raises on every rank naming the unit and what each
rank did. The gradient reductions need no exchange: they run on a process group of their own
([Note: gradient groups] in zerodist/comm/topology.py), where the reducer issues them in one
fixed order whatever the gathers do. At each optimizer step the ranks also compare which
units' forwards ran since the last step, in which order (`RunCheck`, digests carried by the
step's one all-reduce): a divergence that moved no data (everything already gathered) is named
there instead of passing silently.
"""

from __future__ import annotations

from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.zero.units import Unit

class UnitControlFlowError(RuntimeError):
    """Ranks ran different units, or in a different order (see [Note: unit order check])."""


# The name of the stage-3-only days, kept for code that catches it.
Stage3ControlFlowError = UnitControlFlowError


class UnitOrderCheck:
    """Fingerprint exchange before stage-3 collectives ([Note: unit order check])."""

    KINDS = ("gather for forward", "gather for backward")

    def __init__(self, units: list[Unit], group: Group, enabled: bool, device: torch.device):
        # One rank has no one to diverge from, and on a GPU each exchange waits for the device (.tolist()).
        self.units, self.group, self.device = units, group, device
        self.enabled = enabled and comm.get_world_size(group) > 1
        self.counts: dict[tuple[int, int], int] = {}

    def __call__(self, kind: int, unit: Unit, batch: list[Unit] | None = None) -> None:
        """Every rank is about to issue `kind` for `unit` (and gathers for the rest of `batch`):
        one 5-number all-gather; raises on every rank if any rank would do something else."""
        if not self.enabled:
            return
        batch = batch or [unit]
        digest = 0
        for member in batch:  # "time": how often this rank has done `kind` for the unit, prefetches included
            key = (kind, member.index)
            self.counts[key] = self.counts.get(key, 0) + 1
            digest = (digest * 1_000_003 + member.index + 1) % (1 << 61)
        rows = self._exchange([kind, unit.index, self.counts[(kind, unit.index)], len(batch), digest])
        if any(row != rows[0] for row in rows):
            did = "; ".join(
                f"rank {rank} would {self.KINDS[k]} unit '{self.units[u].name}' (time {c})"
                + (f" with {n - 1} more unit(s) prefetched" if n > 1 else "")
                for rank, (k, u, c, n, _) in zip(self._ranks(), rows)
            )
            raise UnitControlFlowError(
                f"ZeRO-3 ranks diverged: {did}. Every rank must run the same units the same number of times "
                "in the same order (same control flow); make data-dependent branches agree across ranks."
            )

    def _exchange(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        size = comm.get_world_size(self.group)
        everyone = torch.empty(len(row) * size, dtype=torch.int64, device=mine.device)
        comm.all_gather(everyone, mine, group=self.group)
        return everyone.view(size, len(row)).tolist()

    def _ranks(self) -> list[int]:
        return [comm.get_global_rank(self.group, r) for r in range(comm.get_world_size(self.group))]


class RunCheck:
    """Which units' forwards ran since the last optimizer step, in which order: compared across
    ranks inside the step's one all-reduce (`ZeroOptimizer.step_checks`), so a divergence that
    moved no data (everything already gathered) is named too ([Note: unit order check])."""

    _KEEP = 10_000  # runs remembered for the message; the digests cover them all

    def __init__(self, units: list[Unit], group: Group):
        self.units, self.group = units, group
        self.runs: list[int] = []
        self.count = 0
        self._digests = [0, 0]

    def record(self, unit: Unit) -> None:
        self.count += 1
        if len(self.runs) < self._KEEP:
            self.runs.append(unit.index)
        # two independent 20-bit digests: their squares stay exact when summed in float64
        self._digests[0] = (self._digests[0] * 1_000_003 + unit.index + 1) % 1_048_573
        self._digests[1] = (self._digests[1] * 999_983 + self.count * (unit.index + 7)) % 1_048_571

    def digests(self) -> list[int]:
        return [*self._digests, self.count % 1_048_573]

    def reset(self) -> None:
        self.runs, self.count, self._digests = [], 0, [0, 0]

    def explain(self) -> None:
        """Every rank found the digests differ: exchange the runs and raise, naming them."""
        everyone: list[Any] = [None] * comm.get_world_size(self.group)
        comm.all_gather_object(everyone, (self.count, self.runs), group=self.group)
        described = []
        for rank, (count, sequence) in enumerate(everyone):
            counts: dict[int, int] = {}
            for index in sequence:
                counts[index] = counts.get(index, 0) + 1
            listed = ", ".join(f"'{self.units[i].name}' x{n}" for i, n in sorted(counts.items()))
            order = " -> ".join(f"'{self.units[i].name}'" for i in sequence[:50])
            more = f" ({count - 50} more)" if count > 50 else ""
            described.append(f"rank {comm.get_global_rank(self.group, rank)} ran {listed} "
                             f"(in order {order}{more})")
        self.reset()
        raise UnitControlFlowError(
            "ZeRO-3 ranks diverged since the last optimizer step: " + "; ".join(described) + ". Every rank "
            "must run the same units the same number of times in the same order (same control flow); make "
            "data-dependent branches agree across ranks."
        )
