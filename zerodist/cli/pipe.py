"""`zerodist pipe draw`: a pipeline schedule's plan as a picture, without running anything.

    zerodist pipe draw --schedule zb --stages 4 --micro-batches 8            # -> pipeline-zb.png
    zerodist pipe draw --schedule interleaved --stages 4 --stages-per-rank 2 --micro-batches 8 --out plan.png

The schedule is built and checked as the pipeline engine does (zerodist/pipe/schedule.py,
schedule_checks.py), then simulated with the zero-bubble paper's unit costs (F = I = W = 1,
B = 2): a row per pipe rank, forward / backward / input-gradient / weight-gradient actions
coloured, micro-batch numbers on the bars, the idle gaps left blank; the title gives the idle
share beside the formula's. A run's picture beside its plan: `zerodist train --pp P --trace`.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pipe", help="pipeline schedules: draw a schedule's plan (no processes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="pipe_command", required=True, metavar="{draw}")
    draw = actions.add_parser("draw", help="draw a schedule's plan to a PNG", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    draw.add_argument("--schedule", required=True, choices=("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"))
    draw.add_argument("--stages", type=int, required=True, help="pipe ranks (the pipeline degree)")
    draw.add_argument("--micro-batches", type=int, required=True, help="micro-batches per step")
    draw.add_argument("--stages-per-rank", type=int, default=None,
                      help="stages each rank holds (default 2 for interleaved, zbv and dualpipev, else 1)")
    draw.add_argument("--out", default=None, help="PNG path (default pipeline-<schedule>.png)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from zerodist.debug.timeline_analysis import idle_share
    from zerodist.debug.timeline_draw import draw_pipeline
    from zerodist.pipe.schedule import ScheduleArgumentError, build_schedule
    from zerodist.pipe.schedule_checks import Costs, check_schedule
    from zerodist.train.pipe_picture import plan_rows

    per_rank = args.stages_per_rank or (2 if args.schedule in ("interleaved", "zbv", "dualpipev") else 1)
    try:
        schedule = build_schedule(args.schedule, num_ranks=args.stages, num_microbatches=args.micro_batches,
                                  stages_per_rank=per_rank)
        simulated = check_schedule(schedule, num_microbatches=args.micro_batches,
                                   num_stages=args.stages * per_rank, costs=Costs(stage_scale=1 / per_rank))
    except (ScheduleArgumentError, ValueError) as error:
        print(f"zerodist pipe draw: {error}", file=sys.stderr)
        return 2
    p, m, v = args.stages, args.micro_batches, per_rank
    formula = (p - 1) / (v * m + p - 1)
    name = "(p-1)/(v m+p-1)" if args.schedule != "zb" else "1F1B's (p-1)/(m+p-1)"
    if args.schedule in ("zbv", "dualpipev"):  # [Note: V schedules] in zerodist/pipe/schedule.py
        formula, name = (p - 1) / (6 * m + p - 1), "the V's (p-1)/(6m+p-1)"
    path = args.out or f"pipeline-{args.schedule}.png"
    try:
        draw_pipeline([(f"{args.schedule}, {p} ranks x {v} stage(s), {m} micro-batches (simulator, F = I = W = 1, "
                        f"B = 2; formula {name} = {formula:.3f})", plan_rows(simulated), "time units")], path)
    except ImportError:
        print("zerodist pipe draw: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {path}: idle {idle_share(plan_rows(simulated)):.3f} of all ranks' time (simulator), formula "
          f"{name} = {formula:.3f}")
    return 0
