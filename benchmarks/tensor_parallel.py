"""Tensor parallelism at degree 2: zerodist with and without Domino against PyTorch's DTensor.

    python -m zerodist run --nproc 2 benchmarks/tensor_parallel.py [--rounds 12] [--micro-batch 8]

The same demo GPT (`bench` preset: d_model 128, 4 blocks, 4 heads, seq 128; same seed and
weights, same batch on both ranks, plain `torch.optim.AdamW`, fp32, no ZeRO) trained on a
tensor-parallel mesh of 2 gloo ranks:

- `zerodist`: `parallelize(model, gpt_plan(), topology)`;
- `zerodist+domino2 inter` / `intra`: the same with `gpt_domino(..., DominoConfig(2, overlap))`;
- `dtensor`: `torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel on QKV and
  `fc_in`, RowwiseParallel on `proj` and `fc_out`, the embedding vocab-parallel and the LM head
  gathered (the same split as zerodist's plan). The demo GPT's attention reshapes with the global
  head count, which a sharded QKV cannot satisfy, so for DTensor each attention is rewritten here
  with the local-head forward and its QKV rows permuted to `[q_r; k_r; v_r]` per rank: the same
  math and weights, so the same loss.

Configurations are interleaved round after round in the same processes (the machine is shared);
each reports its median step time (forward + backward + AdamW), its ratio to DTensor, its first
loss, zerodist's tensor-parallel bytes per step against the formula, and Domino's overlap at the
schedule level (event order) and at the time level (time blocked in waits during one logged
step after the timed rounds against the same all-reduces run alone). gloo on shared CPU cores is not a network: Domino's chunking cost shows, its overlap
benefit mostly does not. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import zerodist.comm as comm
from zerodist.models import GPT, gpt_config
from zerodist.tensor_parallel import DominoConfig, gpt_domino, gpt_plan, parallelize, schedule_log
from zerodist.train.tp_report import gpt_formula


class _LocalHeadsAttention(nn.Module):
    """The demo GPT's attention with the head count taken from the (local) QKV output."""

    def __init__(self, attention: nn.Module, tensor: int):
        super().__init__()
        d_model, self.head_dim = attention.qkv.in_features, attention.qkv.in_features // attention.n_heads
        self.qkv = copy.deepcopy(attention.qkv)
        order = torch.arange(3 * d_model).view(3, tensor, d_model // tensor).transpose(0, 1).reshape(-1)
        with torch.no_grad():  # rows [q; k; v] -> [q_0; k_0; v_0; q_1; ...]: contiguous halves hold whole heads
            self.qkv.weight.copy_(attention.qkv.weight[order])
            self.qkv.bias.copy_(attention.qkv.bias[order])
        self.proj, self.resid_dropout = attention.proj, attention.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.view(batch, seq, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, -1)))


def build_dtensor(reference: GPT) -> GPT:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(reference)
    for block in model.blocks:
        block.attn = _LocalHeadsAttention(block.attn, dist.get_world_size())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for index in range(len(model.blocks)):
        plan.update({f"blocks.{index}.attn.qkv": ColwiseParallel(), f"blocks.{index}.attn.proj": RowwiseParallel(),
                     f"blocks.{index}.mlp.fc_in": ColwiseParallel(), f"blocks.{index}.mlp.fc_out": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def build_all(topology: comm.Topology) -> dict[str, GPT]:
    torch.manual_seed(0)
    reference = GPT(gpt_config("bench"))
    models = {"dtensor": build_dtensor(reference)}
    models["zerodist"] = parallelize(copy.deepcopy(reference), gpt_plan(), topology)
    for overlap in ("inter", "intra"):
        model = parallelize(copy.deepcopy(reference), gpt_plan(), topology)
        models[f"zerodist+domino2 {overlap}"] = gpt_domino(model, topology, DominoConfig(2, overlap))
    return models


def step(model: GPT, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def isolated_seconds(log, topology: comm.Topology) -> dict[str, float]:
    """The logged asynchronous collectives run alone, synchronously, one after another."""
    group, seconds = topology.group("tensor"), {}
    for phase in ("forward", "backward"):
        buffers = [torch.zeros(size // 4) for size in log.issued_sizes(phase)]
        comm.barrier()
        started = time.perf_counter()
        for buffer in buffers:
            comm.all_reduce(buffer, group=group)
        seconds[phase] = time.perf_counter() - started
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topology = comm.Topology(tensor=comm.get_world_size())
    models = build_all(topology)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    config = gpt_config("bench")
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len), generator=generator)
    targets = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len), generator=generator)
    first_loss, logs, times = {}, {}, {name: [] for name in models}
    for name, model in models.items():  # warm-up step
        first_loss[name] = step(model, optimizers[name], idx, targets)
    names = list(models)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            comm.barrier()
            started = time.perf_counter()
            step(models[name], optimizers[name], idx, targets)
            times[name].append(time.perf_counter() - started)
    for name, model in models.items():  # one more step, logged: bytes, schedule, time blocked in waits
        comm.barrier()
        with schedule_log() as log:
            step(model, optimizers[name], idx, targets)
        logs[name] = log
    isolated = {name: isolated_seconds(logs[name], topology) for name in names if "domino" in name}
    if comm.get_rank() != 0:
        return
    forward, backward = gpt_formula(tokens=idx.numel(), hidden=config.d_model, vocab=config.vocab_size,
                                    layers=config.n_layers, element_bytes=4)
    baseline = statistics.median(times["dtensor"])
    print(f"GPT bench ({sum(p.numel() for p in GPT(config).parameters()):,} parameters), tensor "
          f"{topology.size('tensor')}, micro-batch {args.micro_batch} x seq {config.seq_len}, {args.rounds} rounds")
    print(f"{'configuration':<26}{'step ms':>10}{'vs dtensor':>12}{'first loss':>12}{'TP bytes fwd/bwd':>22}"
          f"{'overlap fwd/bwd':>17}")
    for name in names:
        median = statistics.median(times[name])
        log = logs[name]
        moved = "-" if name == "dtensor" else f"{log.all_bytes('forward') // 1024}/{log.all_bytes('backward') // 1024} KiB"
        overlap = (f"{100 * log.overlap_fraction('forward'):.0f}%/{100 * log.overlap_fraction('backward'):.0f}%"
                   if "domino" in name else "-")
        print(f"{name:<26}{1e3 * median:>10.1f}{median / baseline:>12.2f}{first_loss[name]:>12.6f}{moved:>22}{overlap:>17}")
    for name, alone in isolated.items():
        log = logs[name]
        parts = []
        for phase in ("forward", "backward"):
            blocked = log.blocked_seconds(phase)
            parts.append(f"{phase} blocked {1e3 * blocked:.1f} ms in waits vs {1e3 * alone[phase]:.1f} ms alone "
                         f"(hidden {100 * (1 - blocked / alone[phase]):.0f}%)")
        print(f"{name} (one step after the rounds, time level): " + "; ".join(parts))
    print(f"formula: forward {forward // 1024} KiB, backward {backward // 1024} KiB per step "
          "((2L+1) all-reduces of T x h, + the LM head's all-gather of T x V forward)")


if __name__ == "__main__":
    main()
