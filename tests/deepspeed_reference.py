"""DeepSpeed's side of the import tests: real DeepSpeed checkpoints and DeepSpeed's own resumed losses.

    DS_ACCELERATOR=cpu python -m tests.deepspeed_reference OUT 1 2 3

On 2 gloo ranks, for each ZeRO stage: train `STEPS_BEFORE` optimizer steps, save a checkpoint
under OUT/stage{S} (with a client_state), then build a fresh model and engine, load the checkpoint
and train `STEPS_AFTER` more steps. Rank 0 writes OUT/losses.json: per stage, the resumed run's
losses per step and rank. The test (tests/checkpoint/test_deepspeed_import.py) resumes the same checkpoint in
zerodist on the same batches and compares. The model, batches and config are defined here once,
for both sides; the config is DeepSpeed JSON that zerodist accepts unchanged.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

WORLD_SIZE = 2
MICRO_BATCH = 2
ACCUMULATION = 2
SEQ = 16
STEPS_BEFORE = 3
STEPS_AFTER = 3
CLIENT_STATE = {"epoch": 7, "note": "from deepspeed"}


def make_model() -> torch.nn.Module:
    """A tiny GPT with tied embeddings (DeepSpeed records them as shared_params)."""
    from zerodist.models.gpt import GPT, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True))


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two optimizer groups, as most training scripts have: no weight decay on biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def config(stage: int) -> dict[str, Any]:
    """DeepSpeed's torch AdamW (torch_adam, adam_w_mode), the same update as zerodist's AdamW;
    DeepSpeed's default gradient clipping (1.0) made explicit; WarmupLR, whose formula and
    iteration numbering after a load zerodist shares."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                                 "torch_adam": True, "adam_w_mode": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 10, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def micro_batch(step: int, micro: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of micro-step `micro` of optimizer step `step` (the same global batch
    for any world size: micro-steps x ranks x rows)."""
    g = torch.Generator().manual_seed(500 + step)
    rows = MICRO_BATCH * ACCUMULATION * WORLD_SIZE
    tokens = torch.randint(0, 64, (rows, SEQ + 1), generator=g)
    per_micro = rows // ACCUMULATION
    local = per_micro // world_size
    start = micro * per_micro + rank * local
    chunk = tokens[start: start + local]
    return chunk[:, :-1], chunk[:, 1:]


def train_steps(engine: Any, first: int, count: int, rank: int, world_size: int) -> list[float]:
    """`count` optimizer steps from step `first`; this rank's loss per micro-step."""
    losses = []
    for step in range(first, first + count):
        for micro in range(ACCUMULATION):
            x, y = micro_batch(step, micro, rank, world_size)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _rank_main(rank: int, port: int, out: str, stages: list[int]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {}
    for stage in stages:
        save_dir = str(Path(out) / f"stage{stage}")
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config(stage))
        train_steps(engine, 0, STEPS_BEFORE, rank, WORLD_SIZE)
        engine.save_checkpoint(save_dir, client_state=CLIENT_STATE)
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config(stage))
        _, client_state = engine.load_checkpoint(save_dir)
        assert client_state["epoch"] == CLIENT_STATE["epoch"]
        losses = train_steps(engine, STEPS_BEFORE, STEPS_AFTER, rank, WORLD_SIZE)
        everyone: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, losses)
        results[str(stage)] = everyone
    if rank == 0:
        (Path(out) / "losses.json").write_text(json.dumps(results))


def main(argv: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.multiprocessing as mp

    out, stages = argv[0], [int(s) for s in argv[1:]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, out, stages), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main(sys.argv[1:])
