"""Tensor parallelism at degree 2 on a Hugging Face Llama: zerodist against PyTorch's DTensor.

    torchrun --nproc_per_node 2 benchmarks/tp_hf_llama.py [--rounds 12] [--micro-batch 4]

The same `LlamaForCausalLM` (hidden 256, 4 layers, 8 heads and 8 key/value heads, intermediate 688,
vocabulary 2048, sequence 128; same seed and weights, same batch on both ranks, plain
`torch.optim.AdamW`, fp32, eager attention) trained on a tensor-parallel mesh of 2 gloo ranks:

- `zerodist`: `parallelize(model, hf_llama_plan(model), topology)` (q/k/v/gate/up column-parallel,
  o/down row-parallel, the embedding vocab-parallel, the LM head gathered);
- `zerodist+domino2 inter`: the same with Domino (2 chunks, inter-layer) on the decoder layers,
  where this tree has Domino for any model (`find_blocks`);
- `dtensor`: `torch.distributed.tensor.parallel.parallelize_module` with the same split
  (ColwiseParallel on q/k/v/gate/up, RowwiseParallel on o/down, the embedding
  `RowwiseParallel(input_layouts=Replicate())`, the LM head `ColwiseParallel(output_layouts=Replicate())`).

Each configuration reports its median step time (forward + backward + AdamW) and its ratio to
DTensor, its first loss, and the collectives of one step: the all-reduce payload in units of one
activation (T x h elements; a Domino chunk counts as its share), and every collective's payload bytes (the full tensor handed to the collective, the
tracer's convention; for DTensor, the functional collectives seen by a dispatch mode). Run it
against an older tree with `PYTHONPATH=<that tree>` to compare before and after; the script uses
only the API both trees have. Configurations are interleaved round after round in the same
processes. gloo on shared CPU cores is not a network. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import zerodist
import zerodist.comm as comm
import zerodist.tensor_parallel as tp

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ = 256, 4, 8, 688, 2048, 128


def build_reference():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=SEQ, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def build_zerodist(reference, domino: bool):
    topology = comm.Topology(tensor=dist.get_world_size())
    model = tp.parallelize(copy.deepcopy(reference), tp.hf_llama_plan(reference), topology)
    if domino:
        tp.apply_domino(tp.find_blocks(model), None, None, tp.DominoConfig(2, "inter"))
    return model


def build_dtensor(reference):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for index in range(LAYERS):
        prefix = f"model.layers.{index}"
        plan.update({f"{prefix}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{prefix}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
        plan.update({f"{prefix}.self_attn.o_proj": RowwiseParallel(), f"{prefix}.mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


class FunctionalCollectives(TorchDispatchMode):
    """(op, payload elements) of every functional collective DTensor issues (payload: the full
    tensor, as zerodist's tracer counts it: an all-gather's output, a reduce-scatter's input)."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.records = world, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if func.namespace == "_c10d_functional" and name.split(".")[0] in COLLECTIVES:
            numel, size = args[0].numel(), args[0].element_size()
            if name.startswith("all_gather"):
                numel *= self.world
            self.records.append((name.split(".")[0], numel, numel * size))
        return func(*args, **(kwargs or {}))


def one_step_collectives(name, model, optimizer, batch):
    """[(op, elements, bytes)] of one forward + backward."""
    if name == "dtensor":
        with FunctionalCollectives(dist.get_world_size()) as mode:
            model(input_ids=batch, labels=batch).loss.backward()
        records = mode.records
    else:
        with comm.trace() as recorded:
            model(input_ids=batch, labels=batch).loss.backward()
        records = [(r.op, r.numel, r.numel * 4) for r in recorded.records]
    optimizer.zero_grad()
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    comm.init_distributed()
    torch.set_num_threads(1)
    reference = build_reference()
    models = {"dtensor": build_dtensor(reference), "zerodist": build_zerodist(reference, False)}
    if hasattr(tp, "find_blocks"):
        models["zerodist+domino2 inter"] = build_zerodist(reference, True)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator)
               for _ in range(args.rounds + args.warmup)]
    tokens = args.micro_batch * SEQ
    collectives = {name: one_step_collectives(name, model, optimizers[name], batches[0])
                   for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    first_loss: dict[str, float] = {}
    for step, batch in enumerate(batches):
        for name, model in models.items():
            dist.barrier()
            started = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            elapsed = time.perf_counter() - started
            first_loss.setdefault(name, loss.item())
            if step >= args.warmup:
                times[name].append(elapsed)
    if dist.get_rank() != 0:
        return
    print(f"zerodist from {zerodist.__file__}; torch {torch.__version__}; HF Llama hidden {HIDDEN}, {LAYERS} layers, "
          f"{HEADS} heads, vocab {VOCAB}; micro-batch {args.micro_batch} x seq {SEQ} = {tokens} tokens; tensor 2")
    base = statistics.median(times["dtensor"])
    print(f"{'configuration':<24} {'step ms':>8} {'vs dtensor':>10} {'first loss':>11} {'all-reduce T*h':>16} "
          f"{'all collectives':>16} {'MiB/step':>9}")
    for name in models:
        records = collectives[name]
        # all-reduce payload in units of one activation (T x h): Domino's chunks count by their share
        activation = sum(numel for op, numel, _ in records if op == "all_reduce") / (tokens * HIDDEN)
        kinds = Counter(op for op, _, _ in records)
        median = statistics.median(times[name])
        print(f"{name:<24} {median * 1e3:>8.1f} {median / base:>10.2f} {first_loss[name]:>11.6f} {activation:>16g} "
              f"{sum(kinds.values()):>16} {sum(b for _, _, b in records) / 2**20:>9.2f}")
    for name in models:
        print(f"  {name}: " + ", ".join(f"{op} x{count}" for op, count in sorted(Counter(op for op, _, _ in
                                                                                     collectives[name]).items())))


if __name__ == "__main__":
    main()
