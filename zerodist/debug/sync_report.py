"""The records and errors of the sync checks (zerodist/debug/sync.py): per parameter, which
ranks disagree, by how much, and each rank's norm, formatted so the error names them."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ParamSync:
    """One parameter (or its gradient) compared across the ranks of a data-parallel group.

    `rank_norms[i]` is the L2 norm that rank `ranks[i]` holds (its whole tensor when replicated,
    the part it owns when sharded; nan when it holds none). `differing_ranks` disagree with
    `reference`: the largest group of bitwise-equal ranks (ties go to the lowest rank), or the
    reference reduction for sharded gradients.
    """

    name: str
    rank_norms: tuple[float, ...]
    max_abs_diff: float
    differing_ranks: tuple[int, ...]
    reference: str
    reference_norm: float | None = None
    tolerance: float = 0.0

    @property
    def in_sync(self) -> bool:
        return not self.differing_ranks


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What `check_gradient_sync` / `check_weight_sync` found. `ranks` are global ranks, in
    group order; `params[i].rank_norms` follows that order."""

    what: str  # "gradients" or "parameters"
    method: str  # how they were compared, for the message
    ranks: tuple[int, ...]
    params: tuple[ParamSync, ...]
    note: str = ""

    @property
    def mismatched(self) -> list[ParamSync]:
        return [p for p in self.params if not p.in_sync]

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def __str__(self) -> str:
        # `print(report)` should read like the error it would raise, not like a dataclass dump
        # (repr() keeps the fields for debugging).
        return self.format()

    def format(self, limit: int = 20) -> str:
        """One header line, then one line per differing parameter (at most `limit`)."""
        bad = self.mismatched
        n = len(self.ranks)
        if not bad:
            head = f"{self.what} in sync across the {n} data-parallel rank(s) for all {len(self.params)} parameters"
            return f"{head} ({self.method})" + (f"; note: {self.note}" if self.note else "")
        lines = [f"{self.what} differ across the {n} data-parallel ranks for {len(bad)} of {len(self.params)} "
                 f"parameter(s) ({self.method}):"]
        lines += [f"  {self._line(p)}" for p in bad[:limit]]
        if len(bad) > limit:
            lines.append(f"  ... and {len(bad) - limit} more: " + ", ".join(p.name for p in bad[limit:]))
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)

    def _line(self, p: ParamSync) -> str:
        who = ", ".join(str(r) for r in p.differing_ranks)
        norms = ", ".join(f"rank {r} {_num(v)}" for r, v in zip(self.ranks, p.rank_norms))
        text = (f"{p.name}: rank{'s' if len(p.differing_ranks) > 1 else ''} {who} "
                f"differ{'' if len(p.differing_ranks) > 1 else 's'} from {p.reference} "
                f"(max abs diff {_num(p.max_abs_diff)}")
        text += f", tolerance {_num(p.tolerance)})" if p.tolerance else ")"
        text += f"; norms: {norms}"
        if p.reference_norm is not None:
            text += f"; reference norm {_num(p.reference_norm)}"
        return text


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4e}"


class SyncError(RuntimeError):
    """Replicas that should be identical are not; `.report` holds the details."""

    def __init__(self, report: SyncReport, check: str):
        super().__init__(f"{check}: {report.format()}")
        self.report = report


class GradientSyncError(SyncError):
    pass


class WeightSyncError(SyncError):
    pass


def reference_label(group_ranks: list[int], members: list[int]) -> str:
    """'rank 0' or 'ranks 0, 1, 3': the ranks whose values the others are compared with."""
    listed = ", ".join(str(group_ranks[i]) for i in members)
    return f"rank {listed}" if len(members) == 1 else f"ranks {listed}"
