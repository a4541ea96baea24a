"""Pipeline schedules as data (zerodist/pipe/schedule.py) and their checks
(schedule_checks.py): pure, no processes.

The acceptance of issue 25's bubble item lives here: the simulator's idle share equals the
closed-form bubble of each schedule, stashed activations peak where the formulas say, and the
compute order equals torch.distributed.pipelining's where the two schedules coincide.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from zerodist.pipe import (
    Action,
    Costs,
    DeadlockError,
    DependencyError,
    IncompleteScheduleError,
    Kind,
    MessageOrderError,
    PlacementError,
    ScheduleArgumentError,
    TimedAction,
    UnmatchedMessageError,
    build_schedule,
    check_schedule,
    format_schedule,
    forward_only,
    measure_timeline,
    message_counts,
    simulate,
    stage_to_rank,
)

pytestmark = pytest.mark.unit

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def _build(name: str, p: int, m: int, v: int = 1, **kw: bool) -> list[list[Action]]:
    return build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v, **kw)


def _compute(schedule: list[list[Action]]) -> list[list[str]]:
    return [[str(a) for a in actions if a.kind.is_compute] for actions in schedule]


# --- the interface the executor codes against -------------------------------------------------

def test_action_is_a_frozen_value_spelled_like_torch():
    action = Action(Kind.SEND_F, 2, 3)
    assert str(action) == "2SEND_F3" and str(Action(F, 0, 1)) == "0F1"
    assert action == Action(Kind.SEND_F, 2, 3) and len({action, Action(Kind.SEND_F, 2, 3)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.stage = 1  # type: ignore[misc]
    assert [k.value for k in Kind] == ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
                                       "UNSHARD", "RESHARD", "REDUCE_GRAD"]  # torch's IR names
    assert str(Action(Kind.UNSHARD, 3, -1)) == "3UNSHARD"


def test_stage_to_rank_loops_and_v_goes_down_then_up():
    assert [stage_to_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ScheduleArgumentError, match="style"):
        stage_to_rank(0, 2, "zigzag")


def test_gpipe_and_1f1b_orders_at_two_ranks_four_microbatches():
    assert _compute(_build("gpipe", 2, 4)) == [
        ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"],
        ["1F0", "1F1", "1F2", "1F3", "1B0", "1B1", "1B2", "1B3"]]
    assert _compute(_build("1f1b", 2, 4)) == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]


def test_sends_follow_their_producer_and_receives_precede_their_consumer():
    schedule = _build("1f1b", 2, 2)
    assert [str(a) for a in schedule[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    # The last stage's F is followed by its own backward: no message for the loss.
    assert [str(a) for a in schedule[1]] == [
        "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
    # One rank: every stage local, no message at all.
    assert all(a.kind.is_compute for a in _build("interleaved", 1, 3, 2)[0])


def test_names_are_case_insensitive():
    assert _build("1F1B", 2, 4) == _build("1f1b", 2, 4)
    assert _build("GPipe", 2, 4) == _build("gpipe", 2, 4)


def test_format_schedule_prints_one_line_per_rank():
    text = format_schedule(_build("gpipe", 2, 1), compute_only=True)
    assert text == "rank 0: 0F0 0B0\nrank 1: 1F0 1B0"


# --- every schedule passes every check --------------------------------------------------------

GRID = ([(name, p, m, 1) for name in ("gpipe", "1f1b", "zb") for p in (1, 2, 3, 4)
         for m in (1, 2, 3, 4, 5, 8)]
        + [("interleaved", p, m, v) for p in (1, 2, 3, 4) for v in (2, 3)
           for m in (p, 2 * p, 3 * p)])


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_every_built_schedule_is_complete_causal_ordered_and_deadlock_free(name, p, m, v):
    schedule = _build(name, p, m, v)
    result = check_schedule(schedule, num_microbatches=m, num_stages=p * v)
    assert result.makespan > 0 and len(result.busy) == p


# --- acceptance: bubble and activations against the formulas ----------------------------------

def _share(result) -> Fraction:
    return Fraction(result.idle_share).limit_denominator(10_000)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("costs", [Costs(), Costs(forward=1, backward=1)], ids=["B=2F", "B=F"])
def test_gpipe_and_1f1b_idle_share_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, costs):
    result = simulate(_build(name, p, m), costs)
    assert _share(result) == Fraction(p - 1, m + p - 1)
    # Every rank idles the same (p - 1)(t_F + t_B): the bubble is not concentrated on one rank.
    assert len(set(result.idle)) == 1
    assert result.makespan == (m + p - 1) * (costs.forward + costs.backward)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_interleaved_idle_share_is_p_minus_1_over_v_m_plus_p_minus_1(p, m):
    v = 2
    # Each of a rank's v stages holds 1/v of its layers: per-stage cost 1/v keeps the total work
    # equal to 1F1B's, so the makespans compare.
    result = simulate(_build("interleaved", p, m, v), Costs(stage_scale=1 / v))
    assert _share(result) == Fraction(p - 1, v * m + p - 1)
    one_f_one_b = simulate(_build("1f1b", p, m))
    assert result.makespan < one_f_one_b.makespan
    assert sum(result.busy) == sum(one_f_one_b.busy)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_zero_bubble_h1_idle_share_is_a_third_of_1f1bs_bubble(p, m):
    # Cost model: F = I = W = 1, a full B = I + W = 2, so both do 3m units of work per rank.
    # ZB-H1 idles (p - 1) per rank, 1F1B 3(p - 1): shares (p-1)/(3m+p-1) and (p-1)/(m+p-1).
    zb = simulate(_build("zb", p, m))
    one_f_one_b = simulate(_build("1f1b", p, m))
    assert _share(zb) == Fraction(p - 1, 3 * m + p - 1)
    assert _share(zb) < _share(one_f_one_b) == Fraction(p - 1, m + p - 1)
    assert zb.busy == one_f_one_b.busy
    assert zb.idle == (p - 1,) * p and one_f_one_b.idle == (3 * (p - 1),) * p


@pytest.mark.parametrize("t_f,t_i,t_w", [(1, 1, 1), (1, 1, 0.5), (1, 2, 1), (2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1_idles_p_minus_1_times_max_tf_plus_ti_minus_tw_and_ti(t_f, t_i, t_w, p, m):
    # Beyond the unit model, this fixed order (torch's) idles (p - 1) max(T_F + T_I - T_W, T_I)
    # per rank when m >= p: the paper's (p - 1)(T_F + T_B - T_W) while T_W <= T_F, never below
    # one input-gradient step per boundary (the I's chain down the pipe at the end).
    costs = Costs(forward=t_f, backward_input=t_i, backward_weight=t_w, backward=t_i + t_w)
    zb, one_f_one_b = simulate(_build("zb", p, m), costs), simulate(_build("1f1b", p, m), costs)
    assert zb.idle == ((p - 1) * max(t_f + t_i - t_w, t_i),) * p
    assert one_f_one_b.idle == ((p - 1) * (t_f + t_i + t_w),) * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 1)])
def test_peak_stashed_activations_min_p_minus_i_m_for_1f1b_and_m_for_gpipe(p, m):
    assert simulate(_build("1f1b", p, m)).peak_activations == {i: min(p - i, m) for i in range(p)}
    assert simulate(_build("gpipe", p, m)).peak_activations == {i: m for i in range(p)}
    # ZB-H1 holds a micro-batch until its W: min(p, m) on every stage, 1F1B's peak (rank 0's),
    # which is the paper's "same memory as 1F1B".
    assert simulate(_build("zb", p, m)).peak_activations == {i: min(p, m) for i in range(p)}


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 2)])
def test_interleaved_stashes_warmup_plus_one_chunks_per_rank(p, m, v):
    # Rank r runs (v - 1) p + 2 (p - 1 - r) warm-up forwards and one more before its first
    # backward; each is one chunk's activations (1/v of the rank's layers). At v = 2, p = 4 rank
    # 0 thus holds 11 half-stages = 5.5 stages' worth against 1F1B's 4: interleaving trades
    # memory (and v times the messages) for its smaller bubble.
    result = simulate(_build("interleaved", p, m, v))
    assert result.peak_activations_by_rank == tuple(
        min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m) for r in range(p))
    assert simulate(_build("1f1b", p, m)).peak_activations_by_rank == tuple(
        min(p - r, m) for r in range(p))


def test_measure_timeline_summarises_an_executor_trace_like_the_simulator():
    simulated = simulate(_build("1f1b", 2, 4))
    # A trace as an executor would record it: wall-clock times with an arbitrary origin.
    trace = [[TimedAction(t.action, 1000 + t.start, 1000 + t.end) for t in events]
             for events in simulated.timeline]
    measured = measure_timeline(trace)
    assert (measured.makespan, measured.busy, measured.idle_share) == (
        simulated.makespan, simulated.busy, simulated.idle_share)
    assert measured.peak_activations == simulated.peak_activations


def test_latency_lengthens_the_makespan_by_the_messages_on_the_critical_path():
    # GPipe at p = 2: the critical path crosses the boundary once down and once up.
    base = simulate(_build("gpipe", 2, 4)).makespan
    assert simulate(_build("gpipe", 2, 4), Costs(latency=0.25)).makespan == base + 2 * 0.25
    # 1F1B's steady state waits on a round trip per micro-batch, so latency costs it more: at
    # p = 2, m = 4, 4 latencies (an executor with slow links sees this first).
    base = simulate(_build("1f1b", 2, 4)).makespan
    assert simulate(_build("1f1b", 2, 4), Costs(latency=0.25)).makespan == base + 4 * 0.25


def test_the_schedules_need_sends_that_do_not_block():
    # The contract: an executor issues each SEND as an isend and does not wait on it before its
    # later receives. With blocking (rendezvous) sends 1F1B's steady state deadlocks: rank 0
    # sends micro-batch 1's activation while rank 1 sends micro-batch 0's gradient, and each
    # waits for the other to receive. GPipe survives: its two directions never overlap.
    simulate(_build("gpipe", 4, 8), blocking_sends=True)
    with pytest.raises(DeadlockError, match=r"\(blocking sends\): rank 0 waits at position 3 on "
                                            "0SEND_F1; rank 1 waits at position 3 on 1SEND_B0"):
        simulate(_build("1f1b", 2, 4), blocking_sends=True)
    # Blocking sends that meet their receive cost no time of their own.
    assert simulate(_build("gpipe", 2, 4), blocking_sends=True).makespan == simulate(_build("gpipe", 2, 4)).makespan


def test_simulator_timeline_gives_start_and_end_of_every_action():
    result = simulate(_build("1f1b", 2, 2), Costs(forward=1, backward=2, latency=0.5))
    first = result.timeline[1][:2]
    assert [(str(t.action), t.start, t.end) for t in first] == [("1RECV_F0", 0, 1.5), ("1F0", 1.5, 2.5)]
    assert result.makespan == max(t.end for events in result.timeline for t in events)


# --- evaluation and message counts ---------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb", 2, 3, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 3)])
def test_forward_only_keeps_each_ranks_forwards_in_order_and_is_deadlock_free(name, p, m, v):
    schedule = forward_only(_build(name, p, m, v))
    result = check_schedule(schedule, num_microbatches=m, num_stages=p * v, forward_only=True)
    assert all(a.kind in (F, Kind.SEND_F, Kind.RECV_F) for actions in schedule for a in actions)
    assert result.busy == (float(m * v),) * p  # m forwards of each of v stages, 1 unit each
    with pytest.raises(IncompleteScheduleError, match="has a backward in a forward-only schedule"):
        check_schedule(_build(name, p, m, v), num_microbatches=m, forward_only=True)


def test_message_counts_are_m_each_way_per_boundary_and_v_m_when_interleaved():
    p, m = 4, 8
    assert message_counts(_build("1f1b", p, m)) == {
        **{(r, r + 1): m for r in range(p - 1)}, **{(r + 1, r): m for r in range(p - 1)}}
    assert message_counts(_build("zb", p, m)) == message_counts(_build("gpipe", p, m))
    v = 2
    interleaved = message_counts(_build("interleaved", p, m, v))
    assert {pair: interleaved[pair] for pair in [(0, 1), (1, 0), (2, 3), (3, 2)]} == dict.fromkeys(
        [(0, 1), (1, 0), (2, 3), (3, 2)], v * m)
    assert interleaved[(3, 0)] == interleaved[(0, 3)] == (v - 1) * m


# --- bad arguments are named errors ---------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(name="zigzag"), "unknown pipeline schedule 'zigzag'"),
    (dict(num_ranks=0), "num_ranks must be a positive int"),
    (dict(num_microbatches=0), "num_microbatches must be a positive int"),
    (dict(num_microbatches=2.0), "num_microbatches must be a positive int"),
    (dict(name="interleaved", stages_per_rank=1), "needs stages_per_rank >= 2"),
    (dict(name="interleaved", stages_per_rank=2, num_microbatches=6),
     "multiple of the pipe size: 6 micro-batches over 4 ranks; use 8"),
    (dict(name="1f1b", stages_per_rank=2), "places one stage per rank"),
])
def test_bad_arguments_are_a_named_error_saying_what_to_change(kwargs, message):
    arguments = dict(name="1f1b", num_ranks=4, num_microbatches=8, stages_per_rank=1) | kwargs
    name = arguments.pop("name")
    with pytest.raises(ScheduleArgumentError, match=message.replace("(", r"\(")):
        build_schedule(name, **arguments)


# --- broken schedules are caught, each by its named error -------------------------------------

def _without(schedule, rank: int, text: str):
    copy = [list(actions) for actions in schedule]
    copy[rank] = [a for a in copy[rank] if str(a) != text]
    return copy


def _moved(schedule, rank: int, text: str, to: int):
    copy = [list(actions) for actions in schedule]
    action = next(a for a in copy[rank] if str(a) == text)
    copy[rank].remove(action)
    copy[rank].insert(to, action)
    return copy


def test_a_missing_or_doubled_compute_is_an_incomplete_schedule():
    good = _build("1f1b", 2, 4)
    with pytest.raises(IncompleteScheduleError, match="stage 0, micro-batch 2.*no forward"):
        check_schedule(_without(good, 0, "0F2"), num_microbatches=4)
    doubled = [list(actions) for actions in good]
    doubled[1].append(Action(B, 1, 3))
    with pytest.raises(IncompleteScheduleError, match="2 B actions"):
        check_schedule(doubled, num_microbatches=4)
    zb = _build("zb", 2, 4)
    with pytest.raises(IncompleteScheduleError, match="micro-batch 3\\) has an I but no W"):
        check_schedule(_without(zb, 1, "1W3"), num_microbatches=4)
    mixed = [list(actions) for actions in zb]
    mixed[0].append(Action(B, 0, 0))
    with pytest.raises(IncompleteScheduleError, match="full backward B and a split one"):
        check_schedule(mixed, num_microbatches=4)


def test_an_action_on_the_wrong_rank_is_a_placement_error():
    schedule = _build("gpipe", 2, 2)
    schedule[0].append(Action(W, 1, 0))
    with pytest.raises(PlacementError, match="stage 1, which lives on rank 1"):
        check_schedule(schedule, num_microbatches=2)


def test_a_compute_before_its_input_is_a_dependency_error():
    good = _build("1f1b", 2, 4)
    # The backward of stage 0 moved before the receive of its output gradient.
    with pytest.raises(DependencyError, match="0B0 at position 4 needs 1B0 from rank 1 but no 0RECV_B0"):
        check_schedule(_moved(good, 0, "0B0", 4), num_microbatches=4)
    # The last stage's backward before its own forward.
    with pytest.raises(DependencyError, match="1B1 at position .* runs before 1F1"):
        check_schedule(_moved(good, 1, "1B1", 0), num_microbatches=4)
    zb = _build("zb", 2, 4)
    with pytest.raises(DependencyError, match="0W0 at position 0 runs before 0I0"):
        check_schedule(_moved(zb, 0, "0W0", 0), num_microbatches=4)
    # A send before the compute whose output it sends.
    with pytest.raises(DependencyError, match="0SEND_F1 must come after 0F1"):
        check_schedule(_moved(good, 0, "0SEND_F1", 0), num_microbatches=4)


def test_a_send_without_its_receive_is_an_unmatched_message():
    good = _build("1f1b", 2, 4)
    with pytest.raises(UnmatchedMessageError, match="activation for stage 1, micro-batch 3 is sent but rank 1"):
        check_schedule(_without(good, 1, "1RECV_F3"), num_microbatches=4)
    with pytest.raises(UnmatchedMessageError, match="rank 0 receives the gradient .* which nobody sends"):
        check_schedule(_without(good, 1, "1SEND_B0"), num_microbatches=4)


def test_messages_received_out_of_order_are_a_message_order_error():
    # Rank 1 runs its GPipe backwards last micro-batch first: its gradients leave in the order
    # 1, 0 while rank 0 receives them in the order 0, 1. Tags would save it, list order would not.
    schedule = _build("gpipe", 2, 2)
    schedule[1] = [Action(Kind.RECV_F, 1, 0), Action(F, 1, 0), Action(Kind.RECV_F, 1, 1), Action(F, 1, 1),
                   Action(B, 1, 1), Action(Kind.SEND_B, 1, 1), Action(B, 1, 0), Action(Kind.SEND_B, 1, 0)]
    with pytest.raises(MessageOrderError, match="rank 1 sends the gradient for stage 0, micro-batch 1"):
        check_schedule(schedule, num_microbatches=2)


def test_a_wait_cycle_is_a_deadlock_error_naming_each_blocked_rank():
    # Rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 1's activation,
    # and rank 1 runs every forward before any backward: each waits for the other.
    rank0 = [Action(F, 0, 0), Action(Kind.SEND_F, 0, 0), Action(Kind.RECV_B, 0, 0), Action(B, 0, 0),
             Action(F, 0, 1), Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 0, 1), Action(B, 0, 1)]
    rank1 = [Action(Kind.RECV_F, 1, 0), Action(F, 1, 0), Action(Kind.RECV_F, 1, 1), Action(F, 1, 1),
             Action(B, 1, 0), Action(Kind.SEND_B, 1, 0), Action(B, 1, 1), Action(Kind.SEND_B, 1, 1)]
    with pytest.raises(DeadlockError, match="rank 0 waits at position 2 on 0RECV_B0; rank 1 waits at position 2 on 1RECV_F1"):
        check_schedule([rank0, rank1], num_microbatches=2)


# --- the same orders as torch.distributed.pipelining -------------------------------------------

_TORCH_COMPUTE = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")
_TORCH_MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _torch_schedule(schedule_class, p: int, m: int, stages_per_rank: int, *, with_comms: bool = False):
    """torch's per-rank actions as strings, built without processes: its schedules compute every
    rank's `pipeline_order` in the constructor and read nothing of a stage but a few attributes,
    so a mocked stage does (torch's own `_schedule_visualizer.get_schedule_ops` does the same).
    With comms, torch's `_PipelineScheduleRuntime` inserts the sends and receives, each receive
    deferred to just before its consumer (`defer_pp_recv=True`, as ours are)."""
    from unittest import mock

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    stages = []
    for _ in range(stages_per_rank):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, p, None
        stage.num_stages, stage.stage_index = p * stages_per_rank, 0
        stages.append(stage)
    single = issubclass(schedule_class, schedules.PipelineScheduleSingle)
    order = {rank: [a for a in actions if a is not None and a.computation_type.name in _TORCH_COMPUTE]
             for rank, actions in schedule_class(stages[0] if single else stages, m).pipeline_order.items()}
    kept = _TORCH_COMPUTE
    if with_comms:
        runtime = schedules._PipelineScheduleRuntime(stages, m, defer_pp_recv=True)
        runtime._prepare_schedule_with_comms(order)
        order, kept = runtime.pipeline_order_with_comms, _TORCH_COMPUTE + _TORCH_MESSAGES
    # torch also has UNSHARD / RESHARD / REDUCE_GRAD (FSDP's hooks): the executor's business here.
    return [[str(a) for a in order[rank] if a.computation_type.name in kept] for rank in range(p)]


def _torch_order(schedule_class, p: int, m: int, stages_per_rank: int) -> list[list[str]]:
    return _torch_schedule(schedule_class, p, m, stages_per_rank)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_gpipe_is_torchs_schedule_gpipe(p, m):
    from torch.distributed.pipelining import ScheduleGPipe

    assert _compute(_build("gpipe", p, m)) == _torch_order(ScheduleGPipe, p, m, 1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_1f1b_is_torchs_schedule_1f1b_but_for_its_last_rank_numbering(p, m):
    from torch.distributed.pipelining import Schedule1F1B

    ours, theirs = _compute(_build("1f1b", p, m)), _torch_order(Schedule1F1B, p, m, 1)
    assert ours[:-1] == theirs[:-1]
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1
    # (its counter starts at 0 and is incremented before the first steady-state forward when
    # there is no warm-up), so it lists F1..Fm there; the runtime itself does not read this
    # order. With that shifted back, the orders agree.
    assert theirs[-1][0] == f"{p - 1}F1" and theirs[-1][-2] == f"{p - 1}F{m}"
    shifted = [f"{p - 1}F{int(text.split('F')[1]) - 1}" if "F" in text else text for text in theirs[-1]]
    assert ours[-1] == shifted


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (4, 8, 3), (2, 6, 2)])
def test_interleaved_is_torchs_schedule_interleaved_1f1b(p, m, v):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    assert _compute(_build("interleaved", p, m, v)) == _torch_order(ScheduleInterleaved1F1B, p, m, v)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_zb_is_torchs_interleaved_zero_bubble_at_one_stage_per_rank(p, m):
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    assert _compute(_build("zb", p, m)) == _torch_order(ScheduleInterleavedZeroBubble, p, m, 1)


@pytest.mark.parametrize("schedule_class,name,p,m,v", [
    ("ScheduleGPipe", "gpipe", 4, 8, 1), ("ScheduleInterleavedZeroBubble", "zb", 4, 8, 1),
    ("ScheduleInterleaved1F1B", "interleaved", 2, 4, 2), ("ScheduleInterleaved1F1B", "interleaved", 4, 8, 3),
])
def test_sends_and_receives_sit_where_torchs_deferred_receives_do(schedule_class, name, p, m, v):
    from torch.distributed.pipelining import schedules

    ours = [[str(a) for a in actions] for actions in _build(name, p, m, v)]
    theirs = _torch_schedule(getattr(schedules, schedule_class), p, m, v, with_comms=True)

    def without(rank_actions: list[str], kind: str) -> list[str]:
        return [text for text in rank_actions if kind not in text]

    # Every receive sits right before the same compute, and every send after the same compute, in
    # both. They differ only where torch's rank-parity rule (pytorch#172668: a lower rank posts
    # its pending receives from a peer before it sends to that peer, so that blocking sends
    # cannot wait on each other) moves a receive ahead of a send: "0F1 2RECV_F0 0SEND_F1 2F0"
    # against our "0F1 0SEND_F1 2RECV_F0 2F0". Our sends never block (see the module docstring).
    assert [without(a, "SEND") for a in ours] == [without(a, "SEND") for a in theirs]
    assert [without(a, "RECV") for a in ours] == [without(a, "RECV") for a in theirs]
