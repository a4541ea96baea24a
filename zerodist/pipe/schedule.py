"""Pipeline schedules as data: one list of actions per pipe rank, built without processes.

A schedule says, for every rank of the pipe axis, in which order it runs the forward and backward
of each (stage, micro-batch) and where it sends and receives activations and gradients. It is a
plain value: the executor walks a rank's list, and `schedule_checks` proves a schedule complete,
causal and deadlock-free and measures its bubble and activation memory, both without processes.

Conventions (the executor relies on them):
- Stages are global, `0 .. num_stages - 1` with `num_stages = num_ranks * stages_per_rank`;
  stage `s` lives on rank `stage_to_rank(s, num_ranks)` (`s % num_ranks`, the "loop" placement
  of Megatron's interleaved schedule and of torch's looped schedules).
- The first stage reads the micro-batch, the last stage computes the loss: its F is followed by
  its own backward on the same rank, so there is no send or receive for the first stage's input
  or the last stage's output.
- `SEND_F(s, j)` sends the output of F(s, j) to stage s + 1 and matches `RECV_F(s + 1, j)`;
  `SEND_B(s, j)` sends the input gradient of stage s to stage s - 1 and matches `RECV_B(s - 1, j)`.
  The action names the stage that owns the action's rank-local data, as torch's `_Action` does.
- Communication actions appear only between stages on different ranks. Two consecutive stages on
  one rank (every stage when `num_ranks == 1`) hand the tensor over in memory.
- A SEND comes right after the compute that produces it; a RECV right before the compute that
  consumes it.
- Sends must not block: issue each as an asynchronous send and do not wait on it before later
  receives (waiting on a step's sends at its end is fine). With blocking sends 1F1B's steady
  state deadlocks (`simulate(schedule, blocking_sends=True)` shows where).
- An executor may post a RECV earlier (an async receive posted ahead) because, between any two
  ranks, messages are received in the order they are sent (`schedule_checks.check_message_order`
  proves it for every built schedule), so a receiver that posts its receives in list order never
  matches the wrong message, with or without tags.

docs/design/pipeline_schedules.md has the schedules' sources, formulas and the comparison with
torch.distributed.pipelining and DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleArgumentError",
    "SCHEDULE_NAMES",
    "add_communication",
    "add_sharding",
    "build_schedule",
    "compute_order",
    "dualpipev_rank",
    "format_schedule",
    "forward_only",
    "num_stages_of",
    "receive_in_send_order",
    "schedule_placement",
    "stage_to_rank",
    "zbv_rank",
]


class Kind(enum.Enum):
    F = "F"            # forward of (stage, microbatch)
    B = "B"            # full backward (input and weight gradients)
    I = "I"            # input-gradient half of a split backward (zero-bubble)  # noqa: E741
    W = "W"            # weight-gradient half of a split backward
    SEND_F = "SEND_F"  # send the forward output of (stage, microbatch) to stage+1
    RECV_F = "RECV_F"  # receive the forward input of (stage, microbatch) from stage-1
    SEND_B = "SEND_B"  # send the input gradient of (stage, microbatch) to stage-1
    RECV_B = "RECV_B"  # receive the output gradient of (stage, microbatch) from stage+1
    UNSHARD = "UNSHARD"          # gather the stage's parameters (ZeRO-3's all-gather; stages 1/2: wait
                                 # for the last step's gathers)
    RESHARD = "RESHARD"          # free the stage's gathered parameters
    REDUCE_GRAD = "REDUCE_GRAD"  # the stage's gradients are complete for the batch: reduce them

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_sharding(self) -> bool:
        """UNSHARD, RESHARD and REDUCE_GRAD: local to a rank's stage, no micro-batch, no message."""
        return self in _SHARDING

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
_SHARDING = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})
NO_MICROBATCH = -1  # the micro-batch of a sharding action, which is for the whole batch


@dataclasses.dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int        # global stage index 0..num_stages-1
    microbatch: int

    def __str__(self) -> str:
        # torch's `_Action` spelling ("2F0", "1SEND_B3", "0UNSHARD"), so the two print the same.
        return f"{self.stage}{self.kind.value}{'' if self.kind.is_sharding else self.microbatch}"


Schedule = list[list[Action]]   # one list per pipe rank, in execution order

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank in a "V": rank r holds stages r and 2p - 1 - r


class ScheduleArgumentError(ValueError):
    """The arguments of `build_schedule` do not describe a schedule that can be built."""


def schedule_placement(name: str) -> str:
    """The stage placement a schedule is built for: "v" for ZB-V and DualPipeV, else "loop"."""
    return "v" if isinstance(name, str) and name.lower() in V_SCHEDULES else "loop"


def num_stages_of(num_ranks: int, stages_per_rank: int = 1) -> int:
    return num_ranks * stages_per_rank


def stage_to_rank(stage: int, num_ranks: int, style: str = "loop") -> int:
    """The pipe rank that holds global `stage`.

    "loop" (every schedule built here): stage s on rank s % num_ranks, so rank r holds stages
    r, r + p, r + 2p, ... "v" (ZB-V and DualPipeV, torch's placement of the same name): the
    stages go down the ranks and come back up, so rank r holds r and 2p - 1 - r, and rank 0
    holds the first and the last stage.
    """
    if num_ranks < 1:
        raise ScheduleArgumentError(f"num_ranks must be >= 1, got {num_ranks}")
    if stage < 0:
        raise ScheduleArgumentError(f"stage must be >= 0, got {stage}")
    position, chunk = stage % num_ranks, stage // num_ranks
    if style == "loop":
        return position
    if style == "v":
        return position if chunk % 2 == 0 else num_ranks - 1 - position
    raise ScheduleArgumentError(f"unknown stage placement style {style!r}; use 'loop' or 'v'")


def build_schedule(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    with_communication: bool = True,
    with_sharding: bool = False,
    max_active_stages: int | None = None,
) -> Schedule:
    """The per-rank action lists of schedule `name`.

    name: "gpipe" (all forwards, then all backwards), "1f1b" (PipeDream-Flush, DeepSpeed's
    TrainSchedule and Megatron's default), "interleaved" (Megatron's interleaved 1F1B with
    `stages_per_rank` >= 2 stages per rank, placed round-robin) or "zb" (zero-bubble ZB-H1: the
    backward split into an input-gradient I and a weight-gradient W, the W's deferred into what
    would be 1F1B's bubble). With `with_communication=False` only the compute actions come back;
    `with_sharding` adds each stage's UNSHARD, RESHARD and REDUCE_GRAD (`add_sharding`).
    "zbv" (ZB-V, Qi et al. 2024 section 6) and "dualpipev" (DeepSeek's DualPipeV) need
    `stages_per_rank=2` and place the stages in a V (`stage_to_rank(..., "v")`,
    `schedule_placement`): [Note: V schedules] below.
    """
    order = compute_order(
        name, num_ranks=num_ranks, num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank)
    if with_communication:
        order = add_communication(order, num_ranks=num_ranks, stages_per_rank=stages_per_rank,
                                  placement=schedule_placement(name))
    return add_sharding(order, max_active_stages=max_active_stages) if with_sharding else order


def _validate(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> None:
    if not isinstance(name, str) or name.lower() not in SCHEDULE_NAMES:
        raise ScheduleArgumentError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                         ("stages_per_rank", stages_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleArgumentError(f"{label} must be a positive int, got {value!r}")
    if name.lower() == "interleaved":
        if stages_per_rank < 2:
            raise ScheduleArgumentError(
                f"the interleaved schedule needs stages_per_rank >= 2 (got {stages_per_rank}); "
                "with one stage per rank use '1f1b', which is the same schedule")
        if num_microbatches % num_ranks != 0:
            raise ScheduleArgumentError(
                f"the interleaved schedule needs num_microbatches to be a multiple of the pipe "
                f"size: {num_microbatches} micro-batches over {num_ranks} ranks; use "
                f"{_next_multiple(num_microbatches, num_ranks)} micro-batches (Megatron's rule; "
                "each round sends num_ranks micro-batches through every stage of a rank)")
    elif name.lower() in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ScheduleArgumentError(
                f"schedule {name!r} places exactly two stages per rank in a V (got stages_per_rank="
                f"{stages_per_rank}); build the PipelineModule with stages_per_rank=2, stage_placement='v'")
        if name.lower() == "dualpipev" and num_microbatches < 2 * num_ranks:
            raise ScheduleArgumentError(
                f"DualPipeV needs at least as many micro-batches as stages: {num_microbatches} micro-batches "
                f"for {2 * num_ranks} stages; use {2 * num_ranks} or more (torch's ScheduleDualPipeV rule)")
    elif stages_per_rank != 1:
        raise ScheduleArgumentError(
            f"schedule {name!r} places one stage per rank (got stages_per_rank="
            f"{stages_per_rank}); use 'interleaved' for several stages per rank")


def _next_multiple(value: int, step: int) -> int:
    return -(-value // step) * step


def compute_order(
    name: str, *, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1,
) -> Schedule:
    """The compute actions (F, B, I, W) of each rank, in order, without communication."""
    _validate(name, num_ranks, num_microbatches, stages_per_rank)
    name = name.lower()  # "1F1B", "GPipe" and "ZB" as torch and the papers spell them
    builder: Callable[[int, int, int], list[Action]]
    if name == "gpipe":
        builder = _gpipe_rank
    elif name == "1f1b":
        builder = _one_f_one_b_rank
    elif name == "zb":
        builder = _zero_bubble_h1_rank
    elif name in V_SCHEDULES:
        builder = zbv_rank if name == "zbv" else dualpipev_rank
    else:
        return [_interleaved_rank(rank, num_ranks, num_microbatches, stages_per_rank)
                for rank in range(num_ranks)]
    return [builder(rank, num_ranks, num_microbatches) for rank in range(num_ranks)]


def _gpipe_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    # Every forward, then every backward in micro-batch order (torch's ScheduleGPipe order; the
    # last stage could run its backwards in any order, this one keeps all ranks alike).
    forwards = [Action(Kind.F, rank, j) for j in range(num_microbatches)]
    return forwards + [Action(Kind.B, rank, j) for j in range(num_microbatches)]


def _one_f_one_b_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    # Warm up with the forwards that fill the pipe below this stage (p - 1 - rank of them), then
    # alternate one forward and one backward, then drain the remaining backwards. Stage i thus
    # holds at most min(p - i, m) stashed activations (DeepSpeed's `num_pipe_buffers`).
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    actions = [Action(Kind.F, rank, j) for j in range(warmup)]
    for backward in range(num_microbatches - warmup):
        actions.append(Action(Kind.F, rank, warmup + backward))
        actions.append(Action(Kind.B, rank, backward))
    actions.extend(Action(Kind.B, rank, j) for j in range(num_microbatches - warmup, num_microbatches))
    return actions


def _zero_bubble_h1_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3.1).

    1F1B's order with each B replaced by I (the input gradient, on the critical path between
    stages), and the W's (weight gradients, needed by nobody downstream) deferred: rank r runs
    its first `r` I's without their W and then one W after each I, and the W's it still owes
    after the last I. The deferred W's fill the cool-down, where 1F1B's rank r waits for
    gradients, so with T_F = T_I = T_W the bubble is (p - 1) T instead of 1F1B's 3 (p - 1) T.
    This is torch's interleaved zero-bubble rule (`_get_1f1b_rank_ops` with
    `enable_zero_bubble`, `num_1f1b_microbatches = rank`) taken at one stage per rank.
    """
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    actions = [Action(Kind.F, rank, j) for j in range(warmup)]
    weights_done = 0
    for backward in range(num_microbatches):
        if warmup + backward < num_microbatches:
            actions.append(Action(Kind.F, rank, warmup + backward))
        actions.append(Action(Kind.I, rank, backward))
        if backward >= rank:
            actions.append(Action(Kind.W, rank, weights_done))
            weights_done += 1
    actions.extend(Action(Kind.W, rank, j) for j in range(weights_done, num_microbatches))
    return actions


def _interleaved_rank(
    rank: int, num_ranks: int, num_microbatches: int, stages_per_rank: int,
) -> list[Action]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2) for one rank.

    The rank's k-th forward unit is (local chunk, micro-batch) = ((k // p) % v, p * (k // (p v))
    + k % p): rounds of p micro-batches go through chunk 0, then chunk 1, ... The backward units
    run the chunks in reverse. Warm-up: (v - 1) p + 2 (p - 1 - rank) forwards, capped at v m,
    then one forward and one backward alternate, then the backwards drain. Unlike Megatron there
    is no special case for m == p (Megatron then runs every forward first); torch has none either.
    """
    units = num_microbatches * stages_per_rank
    warmup = min((stages_per_rank - 1) * num_ranks + 2 * (num_ranks - 1 - rank), units)

    def unit(kind: Kind, index: int) -> Action:
        chunk = (index // num_ranks) % stages_per_rank
        if kind is Kind.B:
            chunk = stages_per_rank - 1 - chunk
        microbatch = (index // (num_ranks * stages_per_rank)) * num_ranks + index % num_ranks
        return Action(kind, chunk * num_ranks + rank, microbatch)

    actions = [unit(Kind.F, k) for k in range(warmup)]
    for backward in range(units - warmup):
        actions.append(unit(Kind.F, warmup + backward))
        actions.append(unit(Kind.B, backward))
    actions.extend(unit(Kind.B, k) for k in range(units - warmup, units))
    return actions


# [Note: V schedules]
# The V-shaped schedules: two stages per rank, rank r holding stages r and 2p - 1 - r, so the
# first and the last stage are on rank 0 and the micro-batch goes down the ranks and back up.
#
# - ZB-V (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241,
#   section 6): 1F1B-like on the V with the backward split into I and W; the W's fill what would
#   be the bubble.
# - DualPipeV (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.1, and the DualPipe
#   repository's "DualPipeV", the V cut of DualPipe): the forward of one chunk paired with the
#   backward of the other in the steady state (on a GPU the two overlap computation with the
#   all-to-all of expert parallelism; here they run one after the other), zero-bubble I/W split
#   in the second half of the cool-down.
#
# Both orders are torch.distributed.pipelining's (`ScheduleZBVZeroBubble`,
# `ScheduleDualPipeV._calculate_single_rank_operations` in torch 2.13) written on zerodist's IR; an
# overlapped F&B is an F followed by a B. tests/pipe/test_zb_v.py compares the two action by action.
#
# Bubble. At the paper's unit costs per chunk (F = I = W = 1, B = 2) the simulator gives both
# schedules the V's fill: every rank idles p - 1 chunk forwards over the step, an idle share of
# (p - 1)/(6m + p - 1) (tests/pipe/test_zb_v.py, p = 2..4). How that meets the published formulas
# (ZB-V's 0 counted per rank's own span; DualPipeV's (PP/2 - 1)(F&B + B - 3W) with DeepSeek's pairs
# as one unit, which zerodist relaxes to F then B): [Note: published bubbles] in zerodist/pipe/bubbles.py.


def zbv_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """ZB-V's compute order on `rank` (torch's `ScheduleZBVZeroBubble`): warm-up forwards of the
    down chunk, then of both, then F I W of the up chunk; a steady state of F I W on each chunk;
    a cool-down of I's with the W's deferred to the end."""
    p = num_ranks
    m = max(2 * p - 1, num_microbatches)  # filled up to the pipe's depth, the extra ones dropped
    down, up = rank, 2 * p - 1 - rank
    actions: list[Action] = []
    count = {key: 0 for key in ("f0", "f1", "b0", "b1")}

    def add(kind: Kind, chunk: int, counter: str) -> None:
        actions.append(Action(kind, down if chunk == 0 else up, count[counter]))
        count[counter] += 1

    for _ in range(2 * (p - rank) - 1):
        add(Kind.F, 0, "f0")
    for _ in range(rank):
        add(Kind.F, 1, "f1")
        add(Kind.F, 0, "f0")
    for _ in range(p - rank):
        add(Kind.F, 1, "f1")
        actions.append(Action(Kind.I, up, count["b1"]))
        add(Kind.W, 1, "b1")
    while count["f1"] < count["f0"] or count["f0"] < m:
        if count["f0"] < m:
            add(Kind.F, 0, "f0")
        actions.append(Action(Kind.I, down, count["b0"]))
        add(Kind.W, 0, "b0")
        add(Kind.F, 1, "f1")
        actions.append(Action(Kind.I, up, count["b1"]))
        add(Kind.W, 1, "b1")
    w0, w1 = count["b0"], count["b1"]
    for _ in range(rank):
        add(Kind.I, 0, "b0")
        add(Kind.I, 1, "b1")
    for _ in range(p - rank):
        add(Kind.I, 0, "b0")
        actions.append(Action(Kind.W, down, w0))
        w0 += 1
    actions += [Action(Kind.W, up, j) for j in range(w1, count["b1"])]
    actions += [Action(Kind.W, down, j) for j in range(w0, count["b0"])]
    return [a for a in actions if a.microbatch < num_microbatches]


def dualpipev_rank(rank: int, num_ranks: int, num_microbatches: int,
                   pairs: list[int] | None = None) -> list[Action]:
    """DualPipeV's compute order on `rank` (torch's `ScheduleDualPipeV`, from DeepSeek's
    open-source DualPipe): steps 1-8 of that code, an overlapped F&B written as F then B.
    `pairs`, if given, gets the index of each overlapped pair's F (its B follows it)."""
    p = num_ranks
    stage = {0: rank, 1: 2 * p - 1 - rank}
    forward = {0: 0, 1: 0}
    backward = {0: 0, 1: 0}  # next I or B per chunk
    pending_w: list[tuple[int, int]] = []
    actions: list[Action] = []

    def f(chunk: int) -> None:
        actions.append(Action(Kind.F, stage[chunk], forward[chunk]))
        forward[chunk] += 1

    def b(chunk: int, split: bool = False) -> None:
        actions.append(Action(Kind.I if split else Kind.B, stage[chunk], backward[chunk]))
        if split:
            pending_w.append((stage[chunk], backward[chunk]))
        backward[chunk] += 1

    def w() -> None:
        if pending_w:
            s, j = pending_w.pop(0)
            actions.append(Action(Kind.W, s, j))

    for _ in range(2 * (p - rank - 1)):          # 1: F0
        f(0)
    for _ in range(rank + 1):                    # 2: F0 F1
        f(0)
        f(1)
    for _ in range(p - rank - 1):                # 3: I1 W1 F1
        b(1, split=True)
        w()
        f(1)
    marks = pairs if pairs is not None else []
    for i in range(num_microbatches - 2 * p + rank + 1):  # 4: F0&B1, F1&B0
        if not (i == 0 and rank == p - 1):       # DeepSeek's last rank runs its first pair apart
            marks.append(len(actions))
        f(0)
        b(1)
        marks.append(len(actions))
        f(1)
        b(0)
    for _ in range(p - rank - 1):                # 5: B1, F1&B0
        b(1)
        marks.append(len(actions))
        f(1)
        b(0)
    split = False
    for i in range(rank + 1):                    # 6: B1 B0, zero-bubble from the middle on
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        b(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        b(0, split)
    for _ in range(p - rank - 1):                # 7: W0 B0
        w()
        b(0, split)
    for _ in range(rank + 1):                    # 8: W0
        w()
    return actions


def add_communication(order: Schedule, *, num_ranks: int, stages_per_rank: int = 1,
                      placement: str = "loop") -> Schedule:
    """Insert the sends and receives that `order`'s compute actions need.

    A forward of stage s > 0 receives its input right before it runs, and a forward of stage
    s < last sends its output right after; a backward (B or I) of stage s < last receives its
    output gradient right before, and one of stage s > 0 sends its input gradient right after.
    W needs no message. Stages on the same rank exchange nothing (`placement` says which those are).
    """
    num_stages = num_stages_of(num_ranks, stages_per_rank)

    def remote(stage: int, neighbour: int) -> bool:
        return stage_to_rank(stage, num_ranks, placement) != stage_to_rank(neighbour, num_ranks, placement)

    result: Schedule = []
    for actions in order:
        with_messages: list[Action] = []
        for action in actions:
            stage, microbatch = action.stage, action.microbatch
            before: Kind | None = None
            after: Kind | None = None
            if action.kind is Kind.F:
                before = Kind.RECV_F if stage > 0 and remote(stage, stage - 1) else None
                after = Kind.SEND_F if stage < num_stages - 1 and remote(stage, stage + 1) else None
            elif action.kind in (Kind.B, Kind.I):
                before = Kind.RECV_B if stage < num_stages - 1 and remote(stage, stage + 1) else None
                after = Kind.SEND_B if stage > 0 and remote(stage, stage - 1) else None
            if before is not None:
                with_messages.append(Action(before, stage, microbatch))
            with_messages.append(action)
            if after is not None:
                with_messages.append(Action(after, stage, microbatch))
        result.append(with_messages)
    return result if placement == "loop" else receive_in_send_order(result, placement)


def receive_in_send_order(schedule: Schedule, placement: str) -> Schedule:
    """Each rank's receives from one peer moved (earlier only) into the order the peer sends them.

    [Note: V receive order] In a V two ranks exchange two streams (the down chunk's activations
    and the up chunk's gradients one way, the reverse the other way) whose relative order can
    differ between sender and receiver, while messages between two ranks arrive in send order
    (`schedule_checks.check_message_order`). So when a RECV comes up, the receives of what the same
    peer sent before it are placed right before it. That never waits longer: what was sent before
    the message awaited arrives before it."""
    def source(action: Action) -> int:
        peer = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
        return stage_to_rank(peer, len(schedule), placement)

    def key(action: Action) -> tuple[Kind, int, int]:  # a RECV by the SEND it matches
        if action.kind is Kind.SEND_F:
            return Kind.RECV_F, action.stage + 1, action.microbatch
        return Kind.RECV_B, action.stage - 1, action.microbatch

    sent: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.kind.is_send:
                receive = Action(*key(action))
                sent.setdefault((rank, stage_to_rank(receive.stage, len(schedule), placement)), []).append(receive)
    result: Schedule = []
    for rank, actions in enumerate(schedule):
        done: set[Action] = set()
        ordered: list[Action] = []
        for action in actions:
            if action.kind.is_recv:
                if action in done:
                    continue
                queue = sent[(source(action), rank)]
                upto = queue.index(action)
                for earlier in queue[:upto + 1]:
                    if earlier not in done:
                        done.add(earlier)
                        ordered.append(earlier)
                continue
            ordered.append(action)
        result.append(ordered)
    return result


def add_sharding(schedule: Schedule, *, max_active_stages: int | None = None) -> Schedule:
    """Each rank's list with its stages' UNSHARD, RESHARD and REDUCE_GRAD placed (torch pipelining's
    `_add_unshard_reshard` and `_add_reduce_grad` lowering passes).

    [Note: sharding actions] A stage's parameters are gathered (UNSHARD) right before its first
    compute on the rank and freed (RESHARD) right after its last one; its gradients are complete
    after its last weight-gradient action (B, or W of a split backward), where REDUCE_GRAD goes,
    before the RESHARD. So a rank holds gathered only the stages in flight: started and not
    finished. With interleaved stages the rank's first chunk is in flight from the first forward
    to the last backward, so `max_active_stages = k` bounds them instead, as torch's lowering does:
    before each compute, the next k distinct stages of the rank's remaining computes are the ones
    wanted; a gathered stage not among them is freed, a wanted one not gathered is gathered (a
    stage may so be gathered several times per batch; its REDUCE_GRAD stays once, after its last
    weight gradient). A forward-only schedule gets no REDUCE_GRAD.
    """
    if max_active_stages is not None and max_active_stages < 1:
        raise ScheduleArgumentError(f"max_active_stages must be a positive int or None, got {max_active_stages!r}")
    return [_add_sharding_rank(actions, max_active_stages) for actions in schedule]


def _add_sharding_rank(actions: list[Action], window: int | None) -> list[Action]:
    computes = [(index, a) for index, a in enumerate(actions) if a.kind.is_compute]
    last_use = {a.stage: index for index, a in computes}
    last_weight = {a.stage: index for index, a in computes if a.kind in (Kind.B, Kind.W)}
    active: list[int] = []
    result: list[Action] = []
    after: list[Action] = []  # marks that follow a compute, placed after the sends right behind it

    def wanted_at(position: int, stage: int) -> list[int]:
        if window is None:  # every stage in flight: nothing freed before its last use
            return active + ([stage] if stage not in active else [])
        wanted: list[int] = []
        for _, upcoming in (c for c in computes if c[0] >= position):
            if upcoming.stage not in wanted:
                wanted.append(upcoming.stage)
            if len(wanted) == window:
                break
        return wanted

    for position, action in enumerate(actions):
        if not action.kind.is_send:
            result.extend(after)
            after = []
        if action.kind.is_compute:
            wanted = wanted_at(position, action.stage)
            before = [Action(Kind.RESHARD, s, NO_MICROBATCH) for s in active if s not in wanted]
            before += [Action(Kind.UNSHARD, s, NO_MICROBATCH) for s in wanted if s not in active]
            active = [s for s in active if s in wanted] + [s for s in wanted if s not in active]
            # ahead of the receives this compute waits for, so the gather overlaps the wait
            at = len(result)
            while at > 0 and result[at - 1].kind.is_recv:
                at -= 1
            result[at:at] = before
        result.append(action)
        if last_weight.get(action.stage) == position:
            after.append(Action(Kind.REDUCE_GRAD, action.stage, NO_MICROBATCH))
        if last_use.get(action.stage) == position and action.stage in active:
            active.remove(action.stage)
            after.append(Action(Kind.RESHARD, action.stage, NO_MICROBATCH))
    return result + after


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of `schedule` and their messages, in the same order: an evaluation pass
    (DeepSpeed's `eval_batch`), where no backward frees the stashed inputs and none is needed."""
    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return [[action for action in actions if action.kind in keep] for actions in schedule]


def format_schedule(schedule: Schedule, *, compute_only: bool = False) -> str:
    """One line per rank, actions in torch's spelling: `rank 0: 0F0 0SEND_F0 0F1 ...`."""
    lines = []
    for rank, actions in enumerate(schedule):
        shown: Iterable[Action] = (
            (a for a in actions if a.kind.is_compute) if compute_only else actions)
        lines.append(f"rank {rank}: " + " ".join(str(a) for a in shown))
    return "\n".join(lines)
