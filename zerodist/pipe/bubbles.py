"""The published bubble formulas of the pipeline schedules, next to what the simulator gives for
the same order (tests/pipe/test_v_bubbles.py holds the two equal).

    published_idle("dualpipev", num_ranks=4, costs=Costs())     # 6.0: DeepSeek's table
    simulate(dualpipev_paired(4, 10)).idle                      # (6.0, 6.0, 6.0, 6.0)
    own_span_idle(simulate(build_schedule("zbv", ...)))         # (0.0, ...): the ZB paper's "zero"

[Note: published bubbles]
Costs are per chunk (one stage's layers on one micro-batch): F forward, B a full backward = I + W
(input gradient + weight gradient), F&B an overlapped forward-and-backward pair; p ranks.
- 1F1B (p - 1)(F + B) and ZB1P (ZB-H1) (p - 1)(F + B - 2W): DeepSeek's DualPipe README table
  (github.com/deepseek-ai/DualPipe, "Pipeline Bubbles and Memory Usage Comparison"); ZB1P's is the
  Zero Bubble paper's (p - 1)(T_F + T_B - T_W) with its T_B = I. Per rank, over the whole step.
- DualPipeV: (PP/2 - 1)(F&B + B - 3W) with PP the number of stages (2p), the same table. In
  DeepSeek's code (`dualpipe/dualpipev.py`, `_forward_backward_chunk`) a pair is one unit: both
  inputs are received before it starts and both outputs sent after it ends. `dualpipev_paired`
  writes that order on zerodist's IR (the pair's receives moved before its F, its sends after its
  B) and, at F = I = W with F&B = F + B (no second stream to overlap on), the simulator gives every
  rank exactly the formula's 2(p - 1)F: 6 chunk-forwards at p = 4, the idle cells of each device
  in the README's DualPipeV figure (4 ranks, 10 micro-batches). The formula is the figure's cost
  model: at other ratios this fixed order idles otherwise (the test pins the unit model only).
  zerodist's `dualpipev` runs a pair as F then B, so the F does not wait for the B's gradient:
  (p - 1)F per rank at the same costs, half of DeepSeek's (a relaxation of the same order that is
  only possible where nothing overlaps).
- ZB-V: bubble rate 0 at T_F = T_B = T_W (the Zero Bubble repository's table, paper section 6).
  The paper counts each rank from its own first to its own last action (the parallelogram that
  its optimizer post-validation keeps, the ranks starting staggered); `own_span_idle` is that
  figure, 0 on every rank for torch's ZBV order. A step that ends with a synchronous optimizer
  step pays the stagger too: the simulator's makespan idle, (p - 1)F per rank, an idle share of
  (p - 1)/(6m + p - 1) ([Note: V schedules] in schedule.py).
"""

from __future__ import annotations

from zerodist.pipe.schedule import Action, Kind, Schedule, build_schedule, dualpipev_rank
from zerodist.pipe.schedule_checks import Costs, SimulationResult

__all__ = ["dualpipev_paired", "own_span_idle", "published_idle"]


def published_idle(name: str, *, num_ranks: int, costs: Costs) -> float:
    """A rank's idle time in one step by the published formula ([Note: published bubbles]); for
    "zbv" the paper's own-span figure, stated for T_F = T_I = T_W only."""
    p, f, b, w = num_ranks, costs.forward, costs.backward_input + costs.backward_weight, costs.backward_weight
    name = name.lower()
    if name in ("1f1b", "gpipe"):
        return (p - 1) * (f + costs.backward)
    if name == "zb":
        return (p - 1) * (f + b - 2 * w)
    if name == "dualpipev":
        stages = 2 * p  # the formula's PP
        return (stages / 2 - 1) * ((f + b) + b - 3 * w)  # F&B = F + B: nothing to overlap with here
    if name == "zbv":
        if not costs.forward == costs.backward_input == costs.backward_weight:
            raise ValueError("the ZB-V bubble is published for T_F = T_B = T_W only")
        return 0.0
    raise ValueError(f"no published bubble formula for schedule {name!r}")


def own_span_idle(result: SimulationResult) -> tuple[float, ...]:
    """Per rank: the time from its first compute's start to its last compute's end, less its
    compute (the Zero Bubble paper's count, ranks staggered)."""
    idle = []
    for events, busy in zip(result.timeline, result.busy):
        computes = [event for event in events if event.action.kind.is_compute]
        idle.append(computes[-1].end - computes[0].start - busy if computes else 0.0)
    return tuple(idle)


def dualpipev_paired(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV as DeepSeek's code runs it: each overlapped F&B one unit, its receives before its
    F and its sends after its B (the message order between two ranks is kept)."""
    schedule = build_schedule("dualpipev", num_ranks=num_ranks, num_microbatches=num_microbatches,
                              stages_per_rank=2)
    return [_pair(actions, rank, num_ranks, num_microbatches) for rank, actions in enumerate(schedule)]


def _pair(actions: list[Action], rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    pairs: list[int] = []
    order = dualpipev_rank(rank, num_ranks, num_microbatches, pairs)
    computes = [index for index, action in enumerate(actions) if action.kind.is_compute]
    assert [actions[index] for index in computes] == order, "the built schedule is not dualpipev_rank's order"
    result = list(actions)
    for pair in sorted(pairs, reverse=True):  # from the end, so earlier indices stay valid
        f, b = computes[pair], computes[pair + 1]
        assert result[f].kind is Kind.F and result[b].kind in (Kind.B, Kind.I)
        between = result[f + 1: b]  # the F's sends and the B's receives
        receives = [action for action in between if action.kind.is_recv]
        sends = [action for action in between if not action.kind.is_recv]
        result[f: b + 1] = [*receives, result[f], result[b], *sends]
    return result
