"""Sequence parallelism: activation memory per rank at a fixed sequence length, against degree 1.

    python benchmarks/sequence_parallel.py [--seq-len 4096] [--degrees 1 2 4] [--method ulysses]

For each degree P (P gloo ranks, data degree 1, ZeRO stage 0, micro-batch 1, fp32) the demo GPT
(d_model 128, 4 heads, 2 blocks, vocabulary 256, sequence N) trains 3 steps with
`sequence_parallel_size` = P. Each rank reports:
- activation bytes: what autograd saves for backward in one forward (torch's saved-tensor hooks,
  parameters excluded, each storage once; `zerodist.train.seq_report.SavedActivations`);
- the rise of its resident set over one step (peak RSS after the step minus RSS before it; the
  process-lifetime peak, so it shows only when the step sets a new peak: the first step does);
- all-to-all bytes per step on the rank against the Ulysses formula;
- median step time (2 shared cores: degree 4 runs 4 ranks on 2 cores, so times are not speed-ups).
Ratios are against degree 1 measured in the same invocation. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER_FLAG = "--worker"


def worker(args: argparse.Namespace) -> None:
    import torch

    import zerodist
    import zerodist.comm as comm
    from zerodist.debug.memory import peak_rss_bytes, rss_bytes
    from zerodist.models import GPT, gpt_config
    from zerodist.sequence.data import shard_batch
    from zerodist.sequence.layout import SequenceLayout, ulysses_bytes
    from zerodist.train.seq_report import SavedActivations

    torch.manual_seed(0)
    shape = gpt_config("small", seq_len=args.seq_len, n_layers=2)
    degree = int(os.environ["WORLD_SIZE"])
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 10**9,
              "sequence_parallel_size": degree, "zero_optimization": {"stage": 0},
              "zerodist": {"sequence_parallel": {"method": args.method}}}
    engine = zerodist.initialize(model=GPT(shape), config=config)[0]
    layout = SequenceLayout(comm.get_rank(), degree, head_tail=args.method == "ring")
    ids = torch.randint(0, 256, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    batch = shard_batch((ids, torch.roll(ids, -1, 1)), layout) if degree > 1 else (ids, torch.roll(ids, -1, 1))
    activations, times, rises = SavedActivations(engine.module), [], []
    with comm.trace() as trace:
        for step in range(3):
            before = rss_bytes()
            started = time.perf_counter()
            if step == 0:
                with activations.measure():
                    loss = engine(*batch)
            else:
                loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - started)
            rises.append(max(0, peak_rss_bytes() - before))
    formula = 2 * shape.n_layers * ulysses_bytes(batch=1, seq=args.seq_len, heads=shape.n_heads, kv_heads=shape.n_heads,
                                                 head_dim=shape.d_model // shape.n_heads, degree=degree, element_size=4)
    result = {"degree": degree, "rank": comm.get_rank(), "activation_bytes": activations.bytes,
              "rss_rise_first_step": rises[0], "all_to_all_per_step": trace.bus_bytes("all_to_all") / 3,
              "formula_per_step": formula if args.method == "ulysses" else None,
              "median_step_s": statistics.median(times)}
    everyone = [None] * degree
    comm.all_gather_object(everyone, result)
    if comm.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for degree in args.degrees:
        command = [sys.executable, "-m", "zerodist", "run", "--nproc", str(degree), __file__, "--seq-len",
                   str(args.seq_len), "--method", args.method, WORKER_FLAG]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
        if line is None:
            print(f"degree {degree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[len("RESULT "):]))
    base = max(r["activation_bytes"] for r in rows[0]) if rows and rows[0][0]["degree"] == 1 else None
    print(f"GPT d_model 128, 4 heads, 2 blocks, N = {args.seq_len}, micro-batch 1, {args.method}")
    print(f"{'P':>3} {'activations/rank MiB':>21} {'x P=1':>7} {'1/P':>6} {'RSS rise MiB':>13} "
          f"{'a2a/step KiB':>13} {'formula KiB':>12} {'step s':>7}")
    for ranks in rows:
        worst = max(ranks, key=lambda r: r["activation_bytes"])
        ratio = f"{worst['activation_bytes'] / base:.3f}" if base else "-"
        formula = "-" if worst["formula_per_step"] is None else f"{worst['formula_per_step'] / 1024:.1f}"
        print(f"{worst['degree']:>3} {worst['activation_bytes'] / 2**20:>21.2f} {ratio:>7} {1 / worst['degree']:>6.3f} "
              f"{max(r['rss_rise_first_step'] for r in ranks) / 2**20:>13.1f} "
              f"{ranks[0]['all_to_all_per_step'] / 1024:>13.1f} {formula:>12} "
              f"{statistics.median(r['median_step_s'] for r in ranks):>7.2f}")


if __name__ == "__main__":
    main()
