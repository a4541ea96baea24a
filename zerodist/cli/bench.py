"""`zerodist bench comm`: bandwidth of each collective at each power-of-two size.

    zerodist bench comm --nproc 2 --out runs/bench-comm --compare-raw
    zerodist run --nproc 8 -m zerodist bench comm --ops all_reduce      # under any launcher

Not under a launcher (no RANK in the environment), it starts its own ranks through
`zerodist run`'s torchrun path; under one, every rank runs it in place. Rank 0 prints the
table and writes bench_comm.csv, bench_comm.json and bench_comm.png to --out.
"""

from __future__ import annotations

import argparse
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    from zerodist.cli.run import add_launch_arguments

    p = subparsers.add_parser("bench", help="measure communication speed (bench comm)")
    p.set_defaults(handler=lambda args: p.print_help() or 0)
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    c = sub.add_parser("comm", help="bus bandwidth of each collective vs message size",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,all_to_all,broadcast",
                   help="comma-separated collectives (default: all five)")
    c.add_argument("--min-bytes", default="1K", help="smallest message, full buffer (default 1K)")
    c.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    c.add_argument("--trials", type=int, default=20, help="timed trials per size (default 20)")
    c.add_argument("--warmups", type=int, default=5, help="untimed trials first (default 5)")
    c.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16", "bfloat16"))
    c.add_argument("--out", default=None, help="directory for bench_comm.csv / .json / .png")
    c.add_argument("--compare-raw", action="store_true",
                   help="also time raw torch.distributed, interleaved, and print zerodist/raw ratios")
    add_launch_arguments(c)
    c.set_defaults(handler=run_comm)


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The same bench for the ranks torchrun starts (launch arguments stay with us)."""
    argv = ["bench", "comm", "--ops", args.ops, "--min-bytes", str(args.min_bytes), "--max-bytes",
            str(args.max_bytes), "--trials", str(args.trials), "--warmups", str(args.warmups), "--dtype", args.dtype]
    if args.out:
        argv += ["--out", os.path.abspath(args.out)]
    if args.compare_raw:
        argv.append("--compare-raw")
    return argv


def run_comm(args: argparse.Namespace) -> int:
    from zerodist.bench.comm import OPS, BenchOptions, parse_bytes

    try:
        ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
        unknown = [op for op in ops if op not in OPS]
        if unknown or not ops:
            raise ValueError(f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPS)}")
        if args.trials < 1 or args.warmups < 0:
            raise ValueError("--trials must be >= 1 and --warmups >= 0")
        options = BenchOptions(ops, parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.trials,
                               args.warmups, args.dtype, args.compare_raw)
    except ValueError as err:
        raise SystemExit(f"zerodist bench comm: {err}") from None
    if "RANK" not in os.environ:
        from zerodist.cli.run import launch, torchrun_argv

        if args.nproc is None:
            import torch

            args.nproc = torch.cuda.device_count() or 2  # one rank would measure nothing
        return launch(torchrun_argv(args, "zerodist", _child_argv(args), module=True), keep_heap=args.keep_heap)
    return _run_in_place(options, args.out)


def _run_in_place(options, out_dir: str | None) -> int:
    import platform

    import torch

    import zerodist
    import zerodist.comm as comm
    from zerodist.bench.comm import format_table, run_comm_bench, write_outputs

    info = comm.init_distributed()
    rows = run_comm_bench(options)
    if info.rank != 0:
        return 0 if all(r.correct for r in rows) else 1
    device = str(comm.device_for_rank())
    print(format_table(rows, backend=info.backend, device=device, options=options))
    if out_dir:
        meta = {
            "world_size": info.world_size, "backend": info.backend, "device": device, "dtype": options.dtype,
            "trials": options.trials, "warmups": options.warmups, "host": platform.node(),
            "torch": torch.__version__, "zerodist": zerodist.__version__,
            "time": "median over trials per rank, then the slowest rank; barrier before each trial",
            "busbw": "nccl-tests: all_reduce 2(n-1)/n, reduce_scatter/all_gather/all_to_all (n-1)/n, broadcast 1",
            "deepspeed_all_reduce_throughput": "2S/t = 2 x algbw = busbw x n/(n-1)",
        }
        for path in write_outputs(rows, out_dir, meta):
            print(f"wrote {path}")
    wrong = [f"{r.op} {r.num_bytes} B" for r in rows if not r.correct]
    if wrong:
        print(f"WRONG results: {', '.join(wrong)}")
    return 1 if wrong else 0
