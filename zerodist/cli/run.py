"""`zerodist run`: a thin layer over torch.distributed.run (the elastic agent).

We never write our own launcher: this builds torchrun's argument list from a smaller, plainer
one and hands over. One machine: `zerodist run --nproc 2 train.py`. Many machines: the same
command on each node with `--nnodes N --rdzv-endpoint HOST:PORT` (elastic rendezvous) or
`--nnodes N --node-rank R --master-addr HOST` (static).

`--as-deepspeed` serves `import deepspeed` from zerodist in every rank, so a tool that trains through
transformers' or accelerate's DeepSpeed path (llamafactory-cli, axolotl, trl, a Trainer with
`deepspeed=`) trains on zerodist unchanged; a command that is not a `.py` file runs as a program
(`zerodist run --as-deepspeed --nproc 2 -- llamafactory-cli train cfg.yaml`). With `--exec` the
command runs once, not under torchrun, for launchers that start the ranks themselves
(`zerodist run --as-deepspeed --exec -- accelerate launch ... train.py`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Any


# [Note: keeping the host heap] glibc hands freed memory at the top of the heap back to the kernel
# (above M_TRIM_THRESHOLD) and maps blocks over M_MMAP_THRESHOLD one by one; both thresholds grow
# on their own as large blocks are freed, but a step that frees more than it held the step before
# (GPipe's every activation, a burst of optimizer state) still hands pages back and faults them in
# again, zeroed, at the next step: 66,000-256,000 minor faults per step in the pipeline benchmark,
# 2-6% of a CPU step. These values, read by glibc when each rank starts, keep what is freed for the
# next allocation instead (as torch's CUDA caching allocator keeps GPU memory): the heap stays at its
# peak. Setting only the trim threshold would do worse than nothing (it fixes the mmap threshold at
# 128 KiB, and every activation is then mapped and unmapped). A value the user set is kept.
KEEP_HEAP_ENV = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
                 "MALLOC_TOP_PAD_": str(1 << 30)}


def keep_heap_environment() -> dict[str, str]:
    """The variables `--keep-heap` adds to the ranks' environment ([Note: keeping the host heap]),
    leaving out any the user set already."""
    return {key: value for key, value in KEEP_HEAP_ENV.items() if key not in os.environ}


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="launch a script on N ranks per node (over torchrun)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
    p.add_argument("--module", "-m", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("--as-deepspeed", action="store_true",
                   help="serve `import deepspeed` from zerodist in every rank (transformers/accelerate's DeepSpeed path "
                        "trains on zerodist; an installed DeepSpeed is never used)")
    p.add_argument("--exec", dest="exec_once", action="store_true",
                   help="with --as-deepspeed: run the command once, not under torchrun (a launcher that starts ranks)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=run)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: GPUs per node, or 1 on CPU)")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic jobs (default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--master-addr", default=None, help="rank 0's host (static rendezvous)")
    p.add_argument("--master-port", type=int, default=None, help="rank 0's port (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (elastic)")
    p.add_argument("--rdzv-id", default="zerodist", help="job id shared by all nodes (elastic)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the whole group up to K times when a rank fails")
    p.add_argument("--keep-heap", action="store_true",
                   help="start the ranks with glibc keeping freed host memory for reuse instead of handing it back to "
                        "the kernel (no page faults from one step's memory at the next; the heap stays at its peak). "
                        "Linux/glibc only; variables you set yourself are kept")


def torchrun_argv(args: argparse.Namespace, script: str, script_args: list[str], module: bool = False) -> list[str]:
    """torchrun's argument list for our launch arguments."""
    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        raise SystemExit(f"zerodist run: --nproc must be >= 1, got {nproc}")
    argv = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint:
        argv += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                 f"--rdzv-id={args.rdzv_id}"]
    elif args.master_addr or args.node_rank is not None or args.nnodes != "1":
        if args.master_addr is None or args.node_rank is None:
            raise SystemExit("zerodist run: a multi-node static launch needs --master-addr and --node-rank "
                             "(or use --rdzv-endpoint HOST:PORT for an elastic launch)")
        argv += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
                 f"--master-port={args.master_port or 29500}"]
    else:
        argv.append("--standalone")  # one node: torchrun picks a free port itself
    if module:
        argv.append("--module")
    elif not script.endswith(".py") and not os.path.isfile(script) and shutil.which(script):
        argv.append("--no-python")  # a program on PATH (llamafactory-cli, trl, axolotl), not a script
    return argv + [script] + list(script_args)


def launch(argv: list[str], *, keep_heap: bool = False) -> int:
    """Run torchrun in this process; returns its exit status instead of raising. `keep_heap`: the
    ranks start with `KEEP_HEAP_ENV` ([Note: keeping the host heap])."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    nproc = int(next(a for a in argv if a.startswith("--nproc-per-node=")).split("=")[1])
    if keep_heap:
        os.environ.update(keep_heap_environment())  # torchrun's ranks inherit the agent's environment
    # torchrun would set 1 thread per rank and warn; share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if "--max-restarts=0" not in argv:
        # A restarted group must not share the agent's store with the attempt before it: torch then
        # reads the dead attempt's rendezvous keys and the new ranks cannot connect (pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun_main(argv)
    except ChildFailedError as failed:
        # Each rank's own error is in its output above; this says how each one ended.
        print("zerodist: " + describe_failures(failed.failures), file=sys.stderr, flush=True)
        codes = {failure.exitcode for failure in failed.failures.values()}
        return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1
    return 0


def describe_failures(failures: dict[int, Any]) -> str:
    """'rank 0 exited with status 2; rank 1 was killed by SIGTERM (-15)', in rank order."""
    parts = []
    for rank, failure in sorted(failures.items()):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {failure.signal_name()} ({failure.exitcode})")
        else:
            parts.append(f"rank {rank} exited with status {failure.exitcode}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    if args.script == "--" and script_args:  # `zerodist run [options] -- command args`
        args.script, script_args = script_args[0], script_args[1:]
    if args.exec_once and not args.as_deepspeed:
        raise SystemExit("zerodist run: --exec runs a launcher with --as-deepspeed; add --as-deepspeed")
    if args.as_deepspeed:
        from zerodist.integrations.as_deepspeed import environment

        os.environ.update(environment())
        if args.exec_once:
            command = [sys.executable, "-m", args.script] if args.module else [args.script]
            return subprocess.call(command + list(script_args))
    return launch(torchrun_argv(args, args.script, script_args, module=args.module), keep_heap=args.keep_heap)
