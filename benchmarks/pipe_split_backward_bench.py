"""What the zero-bubble split costs: one stage's input-gradient pass (I) plus weight-gradient pass
(W) against one ordinary backward (B), on GPT blocks, in one process, interleaved repeats.

    python benchmarks/pipe_split_backward_bench.py [--d-model 512] [--blocks 4] [--batch 4] [--seq 128]

Three arms over the same graph: "B" (`torch.autograd.backward`), "I+W" (zerodist/pipe/
backward_split.py, [Note: split backward]) and "I+W before" (the split this replaced: I by
`autograd.grad(..., retain_graph=True)` to the inputs, W by `backward(roots, inputs=params)`,
which walks the input-gradient path a second time). Each figure is the median CPU time of the
process (`time.process_time`, one thread: the work done, not the time a loaded machine took to
schedule it) over B's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from zerodist.models.gpt import Block, GPTConfig
    from zerodist.pipe.backward_split import input_backward, weight_backward

    torch.set_num_threads(args.threads)
    config = GPTConfig(seq_len=args.seq, d_model=args.d_model, n_layers=args.blocks, n_heads=8)
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*[Block(config) for _ in range(args.blocks)])
    params = list(stage.parameters())
    x = torch.randn(args.batch, args.seq, args.d_model)
    grad = torch.randn_like(x)

    def forward():  # type: ignore[no-untyped-def]
        leaf = x.detach().requires_grad_(True)
        return leaf, stage(leaf.clone())

    def ordinary() -> float:
        _, out = forward()
        start = time.process_time()
        out.backward(grad)
        return time.process_time() - start

    def split() -> float:
        leaf, out = forward()
        start = time.process_time()
        _, kept = input_backward([out], [grad], [leaf])
        weight_backward(kept, params)
        return time.process_time() - start

    def before() -> float:
        leaf, out = forward()
        start = time.process_time()
        torch.autograd.grad([out], [leaf], [grad], retain_graph=True)
        torch.autograd.backward([out], [grad], inputs=params)
        return time.process_time() - start

    arms = {"B": ordinary, "I+W": split, "I+W before": before}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(args.repeats + 1):
        for name, arm in arms.items():
            stage.zero_grad(set_to_none=True)
            elapsed = arm()
            if repeat:
                times[name].append(elapsed)
    base = statistics.median(times["B"])
    print(f"{args.blocks} GPT blocks, d_model {args.d_model}, batch {args.batch}x{args.seq}, {args.threads} thread(s), "
          f"median of {args.repeats}")
    for name, values in times.items():
        print(f"{name:<12} {statistics.median(values) * 1e3:9.1f} ms  {statistics.median(values) / base:6.3f}x B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
