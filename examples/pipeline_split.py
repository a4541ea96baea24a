"""A Hugging Face Llama the user wrote, split into pipeline stages that keep its parameter names.

    zerodist run --nproc 2 examples/pipeline_split.py                        # pipe 2, cuts balanced
    zerodist run --nproc 4 examples/pipeline_split.py --split-points model.layers.1 --stage 3   # pipe 2 x data 2

Prints each rank's stage (where it starts, a few of its own state-dict keys), each step's loss
(the same on every rank), and on rank 0 whether the stages' keys together are the model's.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import zerodist
import zerodist.comm as comm
from zerodist.pipe import split_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split-points", nargs="*", default=None, help="a stage starts at each (model.layers.N)")
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)  # every rank builds the same model, as for data parallelism
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))
    stages = split_model(model, num_stages=None if args.split_points else 2, split_points=args.split_points)
    engine, _, _, _ = zerodist.initialize(model=stages, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": args.stage}})
    keys = list(stages.state_dict())
    print(f"rank {comm.get_rank()}: stage {stages.stage_id} starts at {stages.layer_names[stages.parts[stages.stage_id]]}"
          f", {len(keys)} keys: {keys[0]}, ..., {keys[-1]}", flush=True)
    generator = torch.Generator().manual_seed(engine.topology.axis_rank("data"))
    for step in range(args.steps):
        tokens = torch.randint(0, 128, (4, 2, 17), generator=generator)
        loss = engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]))
        print(f"rank {comm.get_rank()}: step {step} loss {loss.item():.6f}", flush=True)
    everyone: list = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, keys)
    if comm.get_rank() == 0:
        union = {key for rank_keys in everyone for key in rank_keys}
        print(f"the stages' keys together are the model's own: {union == set(model.state_dict())}")
    engine.destroy()


if __name__ == "__main__":
    main()
