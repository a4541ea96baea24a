"""Where a pipeline step's minor page faults happen: per step and per executor action kind, for
each arm of pipe_side_by_side_bench.py run ALONE in its own pair of gloo processes (so no arm
inherits the heap another one left).

    python benchmarks/pipe_faults.py [--arms local zerodist:1f1b deepspeed:TrainSchedule]
                                     [--micro-batches 8] [--steps 5]

Prints, per rank and step, the faults of the whole step and of each kind of action the zerodist
executor ran (F, B, I, W, RECV_*, SEND_*; a DeepSpeed or local arm has only the total), and glibc's
heap (mallinfo2: the main arena's size, what is mmapped, what is free inside the arena). The first
step warms up. docs/pipeline.md ("Memory, page faults and the allocator") has what it showed.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipe_side_by_side_bench as bench  # noqa: E402
from ranks import free_port, run_ranks  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _count_actions(counts: collections.Counter) -> None:
    """Count the faults of every executor action into `counts` (by kind)."""
    from zerodist.pipe import executor

    do = executor._Run.do

    def counted(run, action):  # type: ignore[no-untyped-def]
        before = _faults()
        do(run, action)
        counts[action.kind.value] += _faults() - before

    executor._Run.do = counted


def worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zerodist.comm as comm

    comm.init_distributed()
    if opts.arm.startswith("deepspeed") and bench.deepspeed_missing() is None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    args = argparse.Namespace(vocab=256, seq=128, d_model=opts.d_model, layers=8, batch=4,
                              micro_batches=opts.micro_batches, arms=[opts.arm.split(":")[-1]], rounds=1,
                              baseline=opts.arm.endswith("-base"))
    arms = bench.Arms(rank, args)
    counts: collections.Counter = collections.Counter()
    _count_actions(counts)
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    for step in range(opts.steps):
        counts.clear()
        comm.barrier()
        before = _faults()
        arms.run(opts.arm)
        total = _faults() - before
        heap = mallinfo2()
        comm.barrier()
        print(f"{opts.arm} rank {rank} step {step}: {total} faults {dict(counts)}; arena {heap.arena >> 20} MiB, "
              f"mmapped {heap.hblkhd >> 20} MiB, free in arena {heap.fordblks >> 20} MiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["local", "zerodist:1f1b", bench.DEEPSPEED])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    opts = parser.parse_args()
    for arm in opts.arms:
        if arm.startswith("deepspeed") and bench.deepspeed_missing() is not None:
            print(f"{arm} left out: `import deepspeed` fails here")
            continue
        error = run_ranks(worker, (2, free_port(), argparse.Namespace(**{**vars(opts), "arm": arm})), nprocs=2,
                          timeout_s=3600)
        if error:
            print(f"{arm}: {error}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
