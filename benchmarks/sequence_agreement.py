"""The cost of the always-on shape agreement before the sequence-parallel exchanges (issue 37
item 3; [Note: sequence shape agreement] in zerodist/sequence/agreement.py).

    python benchmarks/sequence_agreement.py [--seq-len 1024] [--rounds 20]

Two gloo ranks, sequence degree 2, the demo GPT 'small' (d_model 128, 4 heads, 2 blocks), micro-
batch 1, ZeRO 0, fp32. Interleaved in each round, on the same warm processes:
- one training step through the engine (forward, backward, step; its forward agrees once);
- the engine's agreement alone (`agree_call_shapes` on the same batch), 20 times, per call;
- one `DistributedAttention` forward + backward with its own group ([1, N/2, 4, 32] q, k, v;
  it agrees at each call, and its four all-to-alls forward and four backward run after);
- the attention's agreement alone (`agree_attention_shapes`), 20 times, per call.
Reported: medians and the agreement's share of what it guards. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WORKER_FLAG = "--worker"


def _per_call(function, calls: int = 20) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls


def worker(args: argparse.Namespace) -> None:
    import torch

    import zerodist
    import zerodist.comm as comm
    from zerodist.models import GPT, gpt_config
    from zerodist.sequence import DistributedAttention, SequenceLayout
    from zerodist.sequence.agreement import agree_attention_shapes, agree_call_shapes
    from zerodist.sequence.data import shard_batch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    shape = gpt_config("small", seq_len=args.seq_len, n_layers=2)
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 10**9,
              "sequence_parallel_size": 2, "zero_optimization": {"stage": 0}}
    engine = zerodist.initialize(model=GPT(shape), config=config)[0]
    group = engine.topology.group("sequence")
    ids = torch.randint(0, 256, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    batch = shard_batch((ids, torch.roll(ids, -1, 1)), SequenceLayout(comm.get_rank(), 2))
    attention = DistributedAttention(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), group, scatter_idx=1, gather_idx=2)
    qkv = [torch.randn(1, 4, args.seq_len // 2, 32, requires_grad=True) for _ in range(3)]

    def train_step() -> None:
        engine.backward(engine(*batch))
        engine.step()

    def attend() -> None:
        attention(*qkv).sum().backward()

    rows = {"step": [], "engine_agreement": [], "attention": [], "attention_agreement": []}
    for _ in range(args.rounds):
        rows["step"].append(_per_call(train_step, 1))
        rows["engine_agreement"].append(_per_call(lambda: agree_call_shapes(list(batch), group, "bench", "cpu")))
        rows["attention"].append(_per_call(attend, 1))
        rows["attention_agreement"].append(_per_call(lambda: agree_attention_shapes(*qkv, group, "bench")))
    result = {name: statistics.median(values) for name, values in rows.items()}
    if comm.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = [sys.executable, "-m", "zerodist", "run", "--nproc", "2", __file__, "--seq-len", str(args.seq_len),
               "--rounds", str(args.rounds), WORKER_FLAG]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
    if line is None:
        print(f"failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return
    r = json.loads(line[len("RESULT "):])
    print(f"demo GPT small, N = {args.seq_len}, sequence 2 (gloo, 2 processes), medians of {args.rounds} rounds")
    print(f"  training step {r['step'] * 1e3:.2f} ms; its agreement (once per forward) "
          f"{r['engine_agreement'] * 1e6:.0f} us = {r['engine_agreement'] / r['step']:.2%} of the step")
    print(f"  DistributedAttention forward+backward {r['attention'] * 1e3:.2f} ms; its agreement (once per call) "
          f"{r['attention_agreement'] * 1e6:.0f} us = {r['attention_agreement'] / r['attention']:.2%} of the call")


if __name__ == "__main__":
    main()
