"""Does the pipeline executor's wall time follow its schedule? Stages whose compute is a sleep (so
that two cores do not decide), real processes, real gloo messages, against the schedule
simulator's makespan for the same costs.

    python benchmarks/pipe_executor_bench.py [--forward-ms 20] [--backward-ms 40] [--repeats 3]
                                             [--activation-numel 4]

Each stage is one layer that sleeps `forward` ms in its forward and `backward` ms in its backward
(an interleaved rank's two chunks each sleep half). For every (schedule, p, m) it prints the
measured wall time of `executor.run` (the median of the repeats, after one warm-up) with each
receive posted when its RECV comes up (the baseline) and with receives posted ahead (the default,
[Note: receives posted ahead] in zerodist/comm/p2p.py), alternated within the same run, the
simulator's makespan with those costs (`Costs(forward, backward, stage_scale=1/v)`, zero message
latency), their ratios, and the bubble share measured from the executor's own trace (receives ahead) against
(p-1)/(m+p-1) (interleaved: (p-1)/(v m+p-1)). "sim+lat" is the simulator again with every
message taking the one-way latency measured in the same run (a ping-pong between ranks 0 and 1):
the time a schedule cannot avoid once messages cost something, v times as many of them on the
critical path when interleaved. "stretch" is the compute actions' measured time over their
planned sleeps (a loaded machine wakes a sleeper late), and "as run" the simulator fed with each
action's measured time and the measured latency: wall / "as run" is what the executor itself
adds (its Python, its polling), the rest is the machine. Zero-bubble (zb) is left out: a sleep stage
sleeps in its input-gradient half only (its W is the weight half of `x * weight`, nothing), so it
would not show where the W's go; benchmarks/pipe_side_by_side_bench.py runs zb on a real model.
Nothing here gates anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import free_port, run_ranks  # noqa: E402

CASES = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 2)]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):  # type: ignore[override]
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(torch.nn.Module):
    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


class MeasuredCosts:
    """The simulator's costs from a run's trace: each compute action takes what it took."""

    def __init__(self, durations: dict, latency: float):
        self.durations, self.latency = durations, latency

    def of(self, action) -> float:  # type: ignore[no-untyped-def]
        return self.durations.get(action, 0.0)


def message_latency(rank: int, world: int, numel: int, rounds: int = 30) -> float:
    """One message's time from send to received (half a ping-pong's median round trip between ranks 0
    and 1, a header and the benchmark's activation): the simulator's `latency`."""
    import zerodist.comm as comm
    from zerodist.comm import p2p

    times = []
    for index in range(rounds + 1):
        comm.barrier()
        start = time.perf_counter()
        if rank == 0:
            p2p.send_message([torch.ones(numel)], 1, label=(9, 0, index)).wait()
            p2p.recv_message(1, label=(9, 1, index), describe="pong")
        elif rank == 1:
            p2p.recv_message(0, label=(9, 0, index), describe="ping")
            p2p.send_message([torch.ones(numel)], 0, label=(9, 1, index)).wait()
        if index:
            times.append((time.perf_counter() - start) / 2)
    everyone: list = [None] * world
    comm.all_gather_object(everyone, statistics.median(times))
    return float(everyone[0])


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zerodist.comm as comm
    from zerodist.pipe import PipelineExecutor, PipelineModule, build_schedule
    from zerodist.pipe.schedule_checks import Costs, TimedAction, measure_timeline, simulate

    comm.init_distributed()
    latency = message_latency(rank, world, args.activation_numel)
    for name, p, m, v in CASES:
        if p != world:
            continue
        forward_s, backward_s = args.forward_ms / 1e3 / v, args.backward_ms / 1e3 / v
        layers = [SleepStage(forward_s, backward_s) for _ in range(p * v)]
        module = PipelineModule(layers, num_stages=p, stages_per_rank=v, partition_method="uniform",
                                loss_fn=lambda out, label: out.sum())
        schedule = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        # the baseline (each receive posted at its RECV) and receives posted ahead, alternated
        executors = {ahead: PipelineExecutor(module, list(range(p)), timeout_s=60, receive_ahead=ahead)
                     for ahead in (False, True)}
        data = [torch.ones(args.activation_numel) for _ in range(m)]
        walls: dict[bool, list[float]] = {False: [], True: []}
        traces: dict[bool, list] = {}
        for repeat in range(args.repeats + 1):
            for ahead, executor in executors.items():
                comm.barrier()
                start = time.perf_counter()
                result = executor.run(schedule[rank], inputs=data, labels=data)
                comm.barrier()
                if repeat:
                    walls[ahead].append(time.perf_counter() - start)
                    traces[ahead] = [TimedAction(e.action, e.start, e.end) for e in result.trace]
        everyone: list = [None] * world
        comm.all_gather_object(everyone, traces[True])
        if rank == 0:
            simulated = simulate(schedule, Costs(forward=args.forward_ms / 1e3, backward=args.backward_ms / 1e3,
                                                 stage_scale=1 / v))
            measured = measure_timeline(everyone)  # clocks are one machine's perf_counter
            formula = (p - 1) / (v * m + p - 1)
            with_latency = simulate(schedule, Costs(forward=args.forward_ms / 1e3, backward=args.backward_ms / 1e3,
                                                    stage_scale=1 / v, latency=latency))
            # the run's own compute times (sleeps overshoot on a loaded machine) and message latency:
            # what is left between this and the wall time is the executor's own overhead
            durations = {e.action: e.end - e.start for rank_trace in everyone for e in rank_trace}
            as_run = simulate(schedule, MeasuredCosts(durations, latency))  # type: ignore[arg-type]
            planned = sum(Costs(forward=args.forward_ms / 1e3, backward=args.backward_ms / 1e3,
                                stage_scale=1 / v).of(a) for a in durations)
            stretch = sum(durations.values()) / planned
            queue.put((name, p, m, v, statistics.median(walls[False]), statistics.median(walls[True]),
                       simulated.makespan, with_latency.makespan, latency, measured.idle_share,
                       simulated.idle_share, formula, as_run.makespan, stretch))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--activation-numel", type=int, default=4,
                        help="fp32 elements of each activation (over 1024, 4 KiB, they travel apart from the header)")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    rows = []
    for world in sorted({p for _, p, _, _ in CASES}):
        error = run_ranks(worker, (world, free_port(), args, queue), nprocs=world, timeout_s=300)
        if error:
            print(f"{world} ranks: {error}")
            return 1
        while not queue.empty():
            rows.append(queue.get())
    print(f"stage forward {args.forward_ms:g} ms, backward {args.backward_ms:g} ms (sleeps); median of "
          f"{args.repeats} runs after a warm-up; activations of {args.activation_numel} fp32; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'schedule':<12} {'p':>2} {'m':>2} {'v':>2} {'at RECV':>8} {'ahead':>7} {'sim':>7} {'ratio':>6} "
          f"{'ratio':>6} {'sim+lat':>7} {'ratio':>6} {'stretch':>7} {'as run':>7} {'ratio':>6} {'bubble':>7} "
          f"{'sim':>6} {'formula':>7}")
    print(f"{'':<12} {'':>2} {'':>2} {'':>2} {'ms':>8} {'ms':>7} {'ms':>7} {'at RECV':>6} {'ahead':>6} "
          f"{'ms':>7} {'ahead':>6} {'':>7} {'ms':>7} {'ahead':>6} {'(trace)':>7}")
    for (name, p, m, v, baseline, wall, simulated, with_latency, latency, bubble, sim_bubble, formula, as_run,
         stretch) in rows:
        print(f"{name:<12} {p:>2} {m:>2} {v:>2} {baseline * 1e3:>8.1f} {wall * 1e3:>7.1f} {simulated * 1e3:>7.1f} "
              f"{baseline / simulated:>6.3f} {wall / simulated:>6.3f} {with_latency * 1e3:>7.1f} "
              f"{wall / with_latency:>6.3f} {stretch:>7.3f} {as_run * 1e3:>7.1f} {wall / as_run:>6.3f} "
              f"{bubble:>7.3f} {sim_bubble:>6.3f} {formula:>7.3f}")
    latencies = sorted({(row[1], row[8]) for row in rows})
    print("sim+lat: the simulator with each message taking the measured one-way latency "
          + ", ".join(f"{lat * 1e3:.2f} ms at p {p}" for p, lat in latencies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
