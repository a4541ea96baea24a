"""The simulator's idle time against the published bubble formulas ([Note: published bubbles] in
zerodist/pipe/bubbles.py): DualPipeV as DeepSeek runs it (each F&B pair one unit) idles exactly
(PP/2 - 1)(F&B + B - 3W); ZB-V's own-span idle is the Zero Bubble paper's 0; ZB-H1's and 1F1B's
per-rank idle are DeepSeek's table's; zerodist's dualpipev (pairs run as F then B) idles half of
DeepSeek's, which is the documented difference."""

from __future__ import annotations

import pytest

from zerodist.pipe.bubbles import dualpipev_paired, own_span_idle, published_idle
from zerodist.pipe.schedule import build_schedule
from zerodist.pipe.schedule_checks import Costs, check_schedule, simulate

pytestmark = pytest.mark.unit

UNIT = [Costs(), Costs(forward=2.5, backward=5.0, backward_input=2.5, backward_weight=2.5)]


def _costs(f: float, i: float, w: float) -> Costs:
    return Costs(forward=f, backward=i + w, backward_input=i, backward_weight=w)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 7), (3, 12), (4, 10), (4, 16)])
@pytest.mark.parametrize("costs", UNIT)
def test_dualpipev_as_deepseek_runs_it_idles_the_published_bubble(p, m, costs):
    schedule = dualpipev_paired(p, m)
    check_schedule(schedule, num_microbatches=m, num_stages=2 * p)
    idle = simulate(schedule, costs).idle
    assert idle == pytest.approx([published_idle("dualpipev", num_ranks=p, costs=costs)] * p)
    assert idle[0] == pytest.approx(2 * (p - 1) * costs.forward)


def test_the_dualpipev_figure():
    # DualPipe README: 4 ranks, 10 micro-batches, F = W = 1 cell, B = 2: six idle cells per device
    assert simulate(dualpipev_paired(4, 10)).idle == pytest.approx([6.0] * 4)


@pytest.mark.parametrize("p,m", [(2, 8), (3, 12), (4, 16)])
def test_zerodist_dualpipev_relaxes_the_pairs(p, m):
    schedule = build_schedule("dualpipev", num_ranks=p, num_microbatches=m, stages_per_rank=2)
    for costs in UNIT:  # F does not wait for its pair's gradient: half of DeepSeek's bubble
        assert simulate(schedule, costs).idle == pytest.approx([(p - 1) * costs.forward] * p)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 12), (4, 8), (4, 16)])
@pytest.mark.parametrize("costs", UNIT)
def test_zbv_is_zero_bubble_as_the_paper_counts(p, m, costs):
    result = simulate(build_schedule("zbv", num_ranks=p, num_microbatches=m, stages_per_rank=2), costs)
    assert own_span_idle(result) == pytest.approx([published_idle("zbv", num_ranks=p, costs=costs)] * p)
    assert result.idle == pytest.approx([(p - 1) * costs.forward] * p)  # the stagger a synchronous step pays


@pytest.mark.parametrize("name", ["1f1b", "zb"])
@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
@pytest.mark.parametrize("fiw", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1.5, 2, 0.5)])
def test_one_stage_schedules_idle_the_published_bubble(name, p, m, fiw):
    costs = _costs(*fiw)
    result = simulate(build_schedule(name, num_ranks=p, num_microbatches=m), costs)
    assert result.idle == pytest.approx([published_idle(name, num_ranks=p, costs=costs)] * p)


def test_zbv_formula_is_stated_for_equal_costs_only():
    with pytest.raises(ValueError, match="T_F = T_B = T_W"):
        published_idle("zbv", num_ranks=2, costs=_costs(2, 1, 1))
