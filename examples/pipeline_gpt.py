"""The demo GPT in pipeline stages, its token embedding tied to the head, on a byte corpus.

    zerodist run --nproc 4 examples/pipeline_gpt.py --pp 2 --schedule 1f1b --stage 2

Prints (rank 0) the stages' layers, the schedule's bubble from the simulator against the formula,
each step's loss (the same on every rank) and the p2p bytes of one step against 2 m x (micro-batch
activation bytes) per stage boundary.
"""

from __future__ import annotations

import argparse

import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import GPTConfig
from zerodist.models.gpt_pipe import gpt_loss, gpt_pipeline_layers
from zerodist.pipe import PipelineModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (pipe ranks)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"])
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    shape = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    per_rank = 2 if args.schedule == "interleaved" else 1
    torch.manual_seed(0)
    model = PipelineModule(gpt_pipeline_layers(shape), num_stages=args.pp, loss_fn=gpt_loss, seed_layers=True,
                           partition_method="type:block", stages_per_rank=per_rank)
    micro = 4
    engine, _, _, _ = zerodist.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "steps_per_print": 10**9,
        "zero_optimization": {"stage": args.stage},
        "zerodist": {"pipeline": {"schedule": args.schedule, "stages_per_rank": per_rank}}})
    text = (open(__file__, "rb").read() * 4)[: 200_000]
    data = torch.tensor(list(text), dtype=torch.long)
    generator = torch.Generator().manual_seed(engine.topology.axis_rank("data"))

    def batches():
        while True:
            starts = torch.randint(0, len(data) - shape.seq_len - 1, (micro,), generator=generator)
            window = torch.stack([data[s: s + shape.seq_len + 1] for s in starts])
            yield window[:, :-1], window[:, 1:]

    stream = batches()
    p, m, v = args.pp, args.micro_batches, per_rank
    if comm.get_rank() == 0:
        print(f"{comm.get_world_size()} ranks: pipe {p} x data {engine.topology.size('data')}, ZeRO {args.stage}, "
              f"schedule {args.schedule} ({v} stage(s) per rank), {m} micro-batches of {micro}")
        print(f"layers per stage: {model.parts}  ({', '.join(model.layer_classes)})")
        label = "1F1B's (p-1)/(m+p-1)" if args.schedule == "zb" else "(p-1)/(v m+p-1)"
        print(f"bubble (simulator, F=I=W=1, B=2): {engine.simulated.idle_share:.3f}; formula {label} = "
              f"{(p - 1) / (v * m + p - 1):.3f}")
    for step in range(args.steps):
        with comm.trace() as trace:
            loss = engine.train_batch(stream)
        sent = torch.tensor([float(trace.total_bytes("send"))])
        comm.all_reduce(sent)
        if comm.get_rank() == 0:
            activation = micro * shape.seq_len * shape.d_model * 4
            boundaries = (p * v - 1) * engine.topology.size("data")
            print(f"step {step + 1}: loss {loss.item():.4f}, p2p {int(sent.item())} bytes = "
                  f"{sent.item() / boundaries / (2 * m * activation):.2f} x 2 m x {activation} per boundary")
    engine.destroy()


if __name__ == "__main__":
    main()
