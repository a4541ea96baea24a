"""Checks and a simulator for pipeline schedules, without processes.

`check_schedule` runs every check and the simulator, and raises a named `ScheduleError` saying
what is wrong and where:
- `IncompleteScheduleError`: a (stage, micro-batch) lacks its F, or its backward (one B, or one
  I and one W), or has one twice, or mixes B with I/W;
- `PlacementError`: an action on a rank that does not hold its stage, or a message between
  stages that are not neighbours on different ranks;
- `DependencyError`: a compute runs before its input exists on its rank (F of s before F of
  s + 1, F before the last stage's backward, backward of s + 1 before the backward of s, I before
  W, each either earlier on the same rank or through a RECV placed before it whose SEND follows
  the producer on the peer rank);
- `UnmatchedMessageError`: a SEND without its RECV on the peer rank, or the other way round;
- `MessageOrderError`: two ranks' messages received in another order than sent;
- `DeadlockError`: the simulator finds every unfinished rank blocked on a receive;
- `ShardingError` (only for a schedule with sharding actions, `schedule.add_sharding`): a compute
  of a stage that is not gathered, an UNSHARD of a gathered stage or a RESHARD of a freed one, a
  stage left gathered at the end, a REDUCE_GRAD missing, repeated, or before a weight gradient.

`peak_gathered` gives, per rank, the most parameter bytes a sharding schedule holds gathered at
once, for given bytes per stage: what the engine's counter measures (zerodist/zero/runtime.py).

Timing model of `simulate` (the executor's benchmark compares wall time against it): every rank
starts at time 0 and runs its list in order; a compute action takes `costs.of(action)` (by kind,
scaled per stage), a SEND takes no time and its message arrives `costs.latency` later, a RECV
blocks until its message has arrived (its TimedAction spans the wait). `measure_timeline` turns
an executor's trace of TimedActions into the same `SimulationResult`, so the two compare field by
field. Idle time of a rank is the makespan minus its busy time,
so the idle share is the bubble share of the formulas: (p - 1)/(m + p - 1) for GPipe and 1F1B.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from zerodist.pipe.schedule import Action, Kind, Schedule, stage_to_rank

__all__ = [
    "Costs",
    "DeadlockError",
    "DependencyError",
    "IncompleteScheduleError",
    "MessageOrderError",
    "PlacementError",
    "ScheduleError",
    "ShardingError",
    "SimulationResult",
    "TimedAction",
    "UnmatchedMessageError",
    "check_completeness",
    "check_dependencies",
    "check_message_order",
    "check_messages",
    "check_placement",
    "check_schedule",
    "check_sharding",
    "measure_timeline",
    "message_counts",
    "peak_activations",
    "peak_activations_by_rank",
    "peak_gathered",
    "schedule_placement_of",
    "simulate",
]


class ScheduleError(ValueError):
    """A pipeline schedule is wrong; the subclass says how."""


class IncompleteScheduleError(ScheduleError):
    pass


class PlacementError(ScheduleError):
    pass


class DependencyError(ScheduleError):
    pass


class UnmatchedMessageError(ScheduleError):
    pass


class MessageOrderError(ScheduleError):
    pass


class ShardingError(ScheduleError):
    """A sharding action (UNSHARD, RESHARD, REDUCE_GRAD) is missing, repeated or out of place."""


class DeadlockError(ScheduleError):
    pass


def _num_stages(schedule: Schedule) -> int:
    stages = [action.stage for actions in schedule for action in actions]
    return max(stages) + 1 if stages else 0


def _rank_of(stage: int, num_ranks: int, placement: str = "loop") -> int:
    return stage_to_rank(stage, num_ranks, placement)


def schedule_placement_of(schedule: Schedule) -> str:
    """The placement a schedule's actions say: "v" when it has two stages per rank and rank 0
    holds the last one (ZB-V, DualPipeV), else "loop" (every other schedule built here)."""
    num_ranks, num_stages = len(schedule), _num_stages(schedule)
    if num_ranks > 1 and num_stages == 2 * num_ranks and any(a.stage == num_stages - 1 for a in schedule[0]):
        return "v"
    return "loop"


def check_completeness(
    schedule: Schedule, num_stages: int, num_microbatches: int, *, forward_only: bool = False,
) -> None:
    """Every (stage, micro-batch) has one F and either one B or one I and one W, nothing else
    (with `forward_only`, one F and no backward)."""
    counts: collections.Counter[tuple[Kind, int, int]] = collections.Counter(
        (a.kind, a.stage, a.microbatch) for actions in schedule for a in actions if a.kind.is_compute)
    for kind, stage, microbatch in counts:
        if not (0 <= stage < num_stages and 0 <= microbatch < num_microbatches):
            raise IncompleteScheduleError(
                f"action {stage}{kind.value}{microbatch} is outside the {num_stages} stages x "
                f"{num_microbatches} micro-batches the schedule was checked for")
    for stage in range(num_stages):
        for microbatch in range(num_microbatches):
            label = f"(stage {stage}, micro-batch {microbatch})"
            seen = {kind: counts[(kind, stage, microbatch)] for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
            for kind, count in seen.items():
                if count > 1:
                    raise IncompleteScheduleError(f"{label} has {count} {kind.value} actions, not one")
            if seen[Kind.F] != 1:
                raise IncompleteScheduleError(f"{label} has no forward F")
            if forward_only:
                if seen[Kind.B] or seen[Kind.I] or seen[Kind.W]:
                    raise IncompleteScheduleError(f"{label} has a backward in a forward-only schedule")
                continue
            split = seen[Kind.I] + seen[Kind.W]
            if seen[Kind.B] and split:
                raise IncompleteScheduleError(f"{label} has a full backward B and a split one (I/W)")
            if not seen[Kind.B] and (seen[Kind.I], seen[Kind.W]) != (1, 1):
                missing = "no backward (a B, or an I and a W)" if not split else (
                    "an I but no W (weight gradient)" if seen[Kind.I]
                    else "a W but no I (input gradient)")
                raise IncompleteScheduleError(f"{label} has {missing}")


def check_placement(schedule: Schedule, num_stages: int, placement: str | None = None) -> None:
    """Each action sits on its stage's rank; messages only cross between neighbouring ranks.
    `placement` ("loop" or "v", `schedule.stage_to_rank`) defaults to `schedule_placement_of`."""
    num_ranks = len(schedule)
    placement = placement or schedule_placement_of(schedule)
    for rank, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            where = f"rank {rank}, position {index}: {action}"
            if _rank_of(action.stage, num_ranks, placement) != rank:
                raise PlacementError(
                    f"{where} is for stage {action.stage}, which lives on rank "
                    f"{_rank_of(action.stage, num_ranks, placement)} ({placement} placement)")
            peer = _peer_stage(action)
            if peer is None:
                continue
            if not 0 <= peer < num_stages:
                raise PlacementError(f"{where} exchanges with stage {peer}, which does not exist")
            if _rank_of(peer, num_ranks, placement) == rank:
                raise PlacementError(
                    f"{where} exchanges with stage {peer} on the same rank; stages on one rank "
                    "hand tensors over in memory")


def _peer_stage(action: Action) -> int | None:
    """The stage on the other end of a message action."""
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        return action.stage + 1
    if action.kind in (Kind.RECV_F, Kind.SEND_B):
        return action.stage - 1
    return None


# A message is named by what it carries: ("F", receiving stage, micro-batch) for an activation,
# ("B", receiving stage, micro-batch) for a gradient.
_MessageKey = tuple[str, int, int]


def _message_key(action: Action) -> _MessageKey:
    if action.kind is Kind.SEND_F:
        return ("F", action.stage + 1, action.microbatch)
    if action.kind is Kind.RECV_F:
        return ("F", action.stage, action.microbatch)
    if action.kind is Kind.SEND_B:
        return ("B", action.stage - 1, action.microbatch)
    if action.kind is Kind.RECV_B:
        return ("B", action.stage, action.microbatch)
    raise ValueError(f"{action} is not a message")


def _describe(key: _MessageKey) -> str:
    carried = "activation" if key[0] == "F" else "gradient"
    return f"the {carried} for stage {key[1]}, micro-batch {key[2]}"


def check_messages(schedule: Schedule) -> None:
    """Every SEND has exactly one RECV on the peer's rank, and every RECV one SEND."""
    num_ranks = len(schedule)
    sends: collections.Counter[_MessageKey] = collections.Counter()
    receives: collections.Counter[_MessageKey] = collections.Counter()
    for actions in schedule:
        for action in actions:
            if action.kind.is_send:
                sends[_message_key(action)] += 1
            elif action.kind.is_recv:
                receives[_message_key(action)] += 1
    for key in sorted(set(sends) | set(receives)):
        peer = _rank_of(key[1], num_ranks, schedule_placement_of(schedule))
        if sends[key] > 1 or receives[key] > 1:
            raise UnmatchedMessageError(
                f"{_describe(key)} is sent {sends[key]} and received {receives[key]} times")
        if not receives[key]:
            raise UnmatchedMessageError(f"{_describe(key)} is sent but rank {peer} never receives it")
        if not sends[key]:
            raise UnmatchedMessageError(f"rank {peer} receives {_describe(key)}, which nobody sends")


def check_message_order(schedule: Schedule) -> None:
    """Between any two ranks, messages are received in the order they are sent (so an executor
    that posts its receives in list order, even ahead of time and without tags, never pairs a
    receive with the wrong message)."""
    num_ranks, placement = len(schedule), schedule_placement_of(schedule)
    sent: dict[tuple[int, int], list[_MessageKey]] = collections.defaultdict(list)
    received: dict[tuple[int, int], list[_MessageKey]] = collections.defaultdict(list)
    for rank, actions in enumerate(schedule):
        for action in actions:
            if not (action.kind.is_send or action.kind.is_recv):
                continue
            key = _message_key(action)
            peer_stage = _peer_stage(action)
            assert peer_stage is not None
            peer = _rank_of(peer_stage, num_ranks, placement)
            if action.kind.is_send:
                sent[(rank, peer)].append(key)
            else:
                received[(peer, rank)].append(key)
    for (source, target), keys in sorted(sent.items()):
        for position, (out, inbound) in enumerate(zip(keys, received[(source, target)])):
            if out != inbound:
                raise MessageOrderError(
                    f"rank {source} sends {_describe(out)} as its message {position} to rank "
                    f"{target}, which expects {_describe(inbound)} there")


def message_counts(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(sending rank, receiving rank) -> messages per run of the schedule. Each is one
    micro-batch's activation (or its gradient), so the p2p bytes a tracer sees on a link are
    this count times that size: 2 m per stage boundary (m each way) for one stage per rank; an
    interleaved rank pair carries every chunk's boundary, v m each way (v - 1 on the wrap from
    the last rank to the first)."""
    num_ranks = len(schedule)
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.kind.is_send:
                counts[(rank, _rank_of(_message_key(action)[1], num_ranks, schedule_placement_of(schedule)))] += 1
    return dict(sorted(counts.items()))


def check_dependencies(schedule: Schedule, num_stages: int) -> None:
    """Each compute's input is on its rank before it runs (see the module docstring)."""
    num_ranks = len(schedule)
    position: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            position[action] = (rank, index)
    for rank, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            for producer, message in _inputs(action, num_stages):
                _check_input(action, (rank, index), producer, message, position, num_ranks)


def _inputs(action: Action, num_stages: int) -> list[tuple[Action, Kind | None]]:
    """(producer compute, the RECV kind that brings its result) for each input of `action`."""
    stage, microbatch = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [(Action(Kind.F, stage - 1, microbatch), Kind.RECV_F)] if stage > 0 else []
    if action.kind is Kind.W:
        return [(Action(Kind.I, stage, microbatch), None)]
    if action.kind not in (Kind.B, Kind.I):
        return []
    inputs: list[tuple[Action, Kind | None]] = [(Action(Kind.F, stage, microbatch), None)]
    if stage < num_stages - 1:
        # The downstream stage's backward is a B or an I, whichever the schedule has.
        inputs.append((Action(action.kind, stage + 1, microbatch), Kind.RECV_B))
    return inputs


def _check_input(
    consumer: Action, where: tuple[int, int], producer: Action, message: Kind | None,
    position: dict[Action, tuple[int, int]], num_ranks: int,
) -> None:
    rank, index = where
    if producer not in position and producer.kind in (Kind.B, Kind.I):
        other = Kind.I if producer.kind is Kind.B else Kind.B
        producer = Action(other, producer.stage, producer.microbatch)
    if producer not in position:
        raise DependencyError(f"rank {rank}: {consumer} needs {producer}, which the schedule lacks")
    producer_rank, producer_index = position[producer]
    if producer_rank == rank:
        if producer_index > index:
            raise DependencyError(
                f"rank {rank}: {consumer} at position {index} runs before {producer} "
                f"(position {producer_index}) that produces its input")
        return
    assert message is not None
    receive = Action(message, consumer.stage, consumer.microbatch)
    if receive not in position or position[receive][0] != rank or position[receive][1] > index:
        raise DependencyError(
            f"rank {rank}: {consumer} at position {index} needs {producer} from rank "
            f"{producer_rank} but no {receive} comes before it")
    send_kind = Kind.SEND_F if message is Kind.RECV_F else Kind.SEND_B
    send = Action(send_kind, producer.stage, producer.microbatch)
    if send not in position or position[send] < (producer_rank, producer_index):
        raise DependencyError(
            f"rank {producer_rank}: {send} must come after {producer} (position {producer_index}), "
            "which produces what it sends")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of each compute action: `by_kind[kind] * stage_scale`. The default is the zero-bubble
    paper's unit model: F = I = W = 1 and a full backward B = I + W = 2. `stage_scale` = 1/v makes
    a schedule with v stages per rank compare with one whose stage holds all v (interleaving cuts
    each rank's model into v chunks, each 1/v of the work)."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    stage_scale: float = 1.0
    latency: float = 0.0  # time from a SEND to its message being receivable

    def of(self, action: Action) -> float:
        by_kind = {Kind.F: self.forward, Kind.B: self.backward,
                   Kind.I: self.backward_input, Kind.W: self.backward_weight}
        return by_kind.get(action.kind, 0.0) * self.stage_scale


@dataclasses.dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What a run of a schedule looked like: from `simulate`, or from an executor's trace through
    `measure_timeline` (so a real run and the simulator are summarised by one piece of code)."""

    makespan: float
    busy: tuple[float, ...]           # compute time of each rank
    timeline: tuple[tuple[TimedAction, ...], ...]  # every action of each rank with its times
    peak_activations: dict[int, int]  # stage -> most stashed forward outputs at once
    # rank -> most stashed forward outputs at once over all its stages (interleaving: each is
    # one chunk's activations, 1/v of a full stage's)
    peak_activations_by_rank: tuple[int, ...] = ()

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: the makespan minus its compute time (the bubble, start and end included)."""
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def idle_share(self) -> float:
        """Idle time over all ranks' time: the "bubble share of wall time" of the formulas."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0


def peak_activations(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most forward outputs stashed at once: an F stashes one, and the backward
    that frees it (B, or W for a split backward, which still needs the layer input) releases it."""
    peaks: dict[int, int] = {}
    for actions in schedule:
        live: collections.Counter[int] = collections.Counter()
        for action in actions:
            if action.kind is Kind.F:
                live[action.stage] += 1
                peaks[action.stage] = max(peaks.get(action.stage, 0), live[action.stage])
            elif action.kind in (Kind.B, Kind.W):
                live[action.stage] -= 1
    return dict(sorted(peaks.items()))


def peak_activations_by_rank(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most forward outputs stashed at once over all of its stages."""
    peaks = []
    for actions in schedule:
        live = peak = 0
        for action in actions:
            live += 1 if action.kind is Kind.F else -1 if action.kind in (Kind.B, Kind.W) else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def measure_timeline(timeline: Sequence[Sequence[TimedAction]]) -> SimulationResult:
    """Summarise per-rank timed actions (an executor's trace, or the simulator's): time runs from
    the earliest start on any rank to the latest end, and a rank is busy while it computes."""
    events = [event for rank_events in timeline for event in rank_events]
    origin = min((event.start for event in events), default=0.0)
    makespan = max((event.end for event in events), default=origin) - origin
    busy = tuple(sum(event.end - event.start for event in rank_events if event.action.kind.is_compute)
                 for rank_events in timeline)
    order = [[event.action for event in rank_events] for rank_events in timeline]
    return SimulationResult(
        makespan=makespan, busy=busy, timeline=tuple(tuple(events) for events in timeline),
        peak_activations=peak_activations(order),
        peak_activations_by_rank=peak_activations_by_rank(order))


def _waits_for(actions: list[Action], cursor: int, key: _MessageKey) -> bool:
    """Whether a rank whose next action is `actions[cursor]` is waiting to receive `key`."""
    if cursor >= len(actions) or not actions[cursor].kind.is_recv:
        return False
    return _message_key(actions[cursor]) == key


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, blocking_sends: bool = False,
) -> SimulationResult:
    """Run `schedule` with blocking receives and raise `DeadlockError` if it stops.

    Sends are buffered (they never wait) unless `blocking_sends`: then a SEND completes only
    when its receiver has reached the matching RECV (a rendezvous, as a blocking `send` or an
    `isend` waited on at once behaves once the message is too large for the transport's
    buffer). The schedules built here assume buffered sends; see the design page for which of
    them also survive blocking ones.
    """
    costs = costs or Costs()
    num_ranks = len(schedule)
    placement = schedule_placement_of(schedule)
    clock = [0.0] * num_ranks
    cursor = [0] * num_ranks
    arrival: dict[_MessageKey, float] = {}
    timeline: list[list[TimedAction]] = [[] for _ in range(num_ranks)]

    def record(rank: int, start: float, end: float) -> None:
        timeline[rank].append(TimedAction(schedule[rank][cursor[rank]], start, end))
        clock[rank] = end
        cursor[rank] += 1

    progressed = True
    while progressed:
        progressed = False
        for rank in range(num_ranks):
            while cursor[rank] < len(schedule[rank]):
                action = schedule[rank][cursor[rank]]
                start = clock[rank]
                if action.kind.is_recv:
                    key = _message_key(action)
                    if key not in arrival:
                        break  # blocked; the sender delivers it (or completes it, rendezvous)
                    # The RECV spans the wait: the timeline shows it, not a gap.
                    record(rank, start, max(start, arrival.pop(key)))
                elif action.kind.is_send and blocking_sends:
                    peer = _rank_of(_message_key(action)[1], num_ranks, placement)
                    if not _waits_for(schedule[peer], cursor[peer], _message_key(action)):
                        break  # blocked until the receiver reaches this message's RECV
                    met = max(start, clock[peer])
                    record(rank, start, met)
                    record(peer, clock[peer], met + costs.latency)
                else:
                    record(rank, start, start + costs.of(action))
                    if action.kind.is_send:
                        arrival[_message_key(action)] = clock[rank] + costs.latency
                progressed = True
    blocked = [rank for rank in range(num_ranks) if cursor[rank] < len(schedule[rank])]
    if blocked:
        waits = "; ".join(
            f"rank {rank} waits at position {cursor[rank]} on {schedule[rank][cursor[rank]]}"
            for rank in blocked)
        sends = "blocking" if blocking_sends else "buffered"
        raise DeadlockError(f"the schedule deadlocks ({sends} sends): {waits}")
    return measure_timeline(timeline)


def check_sharding(schedule: Schedule) -> None:
    """A schedule with sharding actions ([Note: sharding actions] in schedule.py) gathers each stage
    before every compute of it, frees only what is gathered and everything by the end, and reduces
    each stage's gradients once, after its last weight gradient (none in a forward-only one)."""
    for rank, actions in enumerate(schedule):
        gathered: set[int] = set()
        reduced: dict[int, int] = {}
        last_weight: dict[int, int] = {}
        for index, action in enumerate(actions):
            where = f"rank {rank}, position {index}: {action}"
            if action.kind is Kind.UNSHARD:
                if action.stage in gathered:
                    raise ShardingError(f"{where} gathers a stage that is gathered already")
                gathered.add(action.stage)
            elif action.kind is Kind.RESHARD:
                if action.stage not in gathered:
                    raise ShardingError(f"{where} frees a stage that is not gathered")
                gathered.discard(action.stage)
            elif action.kind is Kind.REDUCE_GRAD:
                if action.stage in reduced:
                    raise ShardingError(f"{where} reduces the stage's gradients a second time")
                reduced[action.stage] = index
            elif action.kind.is_compute:
                if action.stage not in gathered:
                    raise ShardingError(f"{where} runs while its stage's parameters are not gathered (no UNSHARD "
                                        "before it since the last RESHARD)")
                if action.kind in (Kind.B, Kind.W):
                    last_weight[action.stage] = index
        if gathered:
            raise ShardingError(f"rank {rank} ends with stage(s) {sorted(gathered)} still gathered (no RESHARD)")
        for stage, index in sorted(last_weight.items()):
            if stage not in reduced:
                raise ShardingError(f"rank {rank}: stage {stage} has no REDUCE_GRAD after its last weight gradient")
            if reduced[stage] < index:
                raise ShardingError(f"rank {rank}: stage {stage}'s REDUCE_GRAD (position {reduced[stage]}) comes "
                                    f"before its last weight gradient (position {index})")
        extra = sorted(set(reduced) - set(last_weight))
        if extra:
            raise ShardingError(f"rank {rank}: REDUCE_GRAD for stage(s) {extra}, which compute no weight gradient")


def peak_gathered(schedule: Schedule, stage_bytes: dict[int, int]) -> tuple[int, ...]:
    """Per rank, the most bytes gathered at once under the schedule's UNSHARD / RESHARD actions,
    `stage_bytes[s]` counted while stage s is gathered (0 for a stage not listed)."""
    peaks = []
    for actions in schedule:
        live = peak = 0
        for action in actions:
            if action.kind is Kind.UNSHARD:
                live += stage_bytes.get(action.stage, 0)
                peak = max(peak, live)
            elif action.kind is Kind.RESHARD:
                live -= stage_bytes.get(action.stage, 0)
        peaks.append(peak)
    return tuple(peaks)


def check_schedule(
    schedule: Schedule, *, num_microbatches: int, num_stages: int | None = None,
    costs: Costs | None = None, forward_only: bool = False, placement: str | None = None,
) -> SimulationResult:
    """Run every check, then the simulator; return its result (bubble, makespan, memory).

    `num_stages` defaults to the highest stage in the schedule plus one: pass it, so that a
    schedule missing its last stage altogether is caught."""
    stages = _num_stages(schedule) if num_stages is None else num_stages
    check_placement(schedule, stages, placement)
    check_completeness(schedule, stages, num_microbatches, forward_only=forward_only)
    check_messages(schedule)
    check_dependencies(schedule, stages)
    check_message_order(schedule)
    if any(action.kind.is_sharding for actions in schedule for action in actions):
        check_sharding(schedule)
    return simulate(schedule, costs)
