"""The V-shaped schedules: two stages per rank, rank r holding stages r and 2p - 1 - r, so the
first and the last stage are on rank 0 and the micro-batch goes down the ranks and back up.

- ZB-V (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241,
  section 6): 1F1B-like on the V with the backward split into I and W; the W's fill what would
  be the bubble.
- DualPipeV (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.1, and the DualPipe
  repository's "DualPipeV", the V cut of DualPipe): the forward of one chunk paired with the
  backward of the other in the steady state (on a GPU the two overlap computation with the
  all-to-all of expert parallelism; here they run one after the other), zero-bubble I/W split
  in the second half of the cool-down.

Both orders are torch.distributed.pipelining's (`ScheduleZBVZeroBubble`,
`ScheduleDualPipeV._calculate_single_rank_operations` in torch 2.13) written on zerodist's IR; an
overlapped F&B is an F followed by a B. tests/pipe/test_zb_v.py compares the two action by action.

Bubble, with F, I (input gradient), W (weight gradient) and B = I + W the costs of one chunk
(half a rank's layers) and the simulator's model (`schedule_checks.simulate`):
- ZB-V: the paper (section 6) gives a bubble of (p - 1)(T_F + T_B - 2 T_W) per rank for whole-
  rank costs, 0 when F = B = W ("zero bubble"); at one-chunk costs F = I = W = 1 every rank idles
  (p - 1) units beyond the m V's of work, so the idle share is (p - 1) / (6m + p - 1), which is the
  published figure's warm-up (the time the first micro-batch takes to reach the last rank) once
  the cool-down W's have filled the rest. `test_zbv_idle_share_is_the_published_formula`.
- DualPipeV: the DualPipe README's table gives (PP/2 - 1)(F&B + B - 3W) for DualPipe with PP
  ranks; DualPipeV runs the same on PP/2 = p ranks, so (p - 1)(F&B + B - 3W) with F&B = F + B
  when the two run one after the other: (p - 1)(F + 2B - 3W), at unit costs (F = I = W = 1,
  B = 2) 2(p - 1) per rank. `test_dualpipev_idle_is_the_published_formula`.
"""

from __future__ import annotations

from zerodist.pipe.schedule import Action, Kind

__all__ = ["dualpipev_rank", "zbv_rank"]


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


def dualpipev_rank(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """DualPipeV's compute order on `rank` (torch's `ScheduleDualPipeV`, from DeepSeek's
    open-source DualPipe): steps 1-8 of that code, an overlapped F&B written as F then B."""
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
    for i in range(num_microbatches - 2 * p + rank + 1):  # 4: F0&B1, F1&B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - rank - 1):                # 5: B1, F1&B0
        b(1)
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
