"""A damaged shard in the newest checkpoint, then an automatic restart with `skip_damaged`.

    python -m zerodist run --nproc 2 --max-restarts 2 tests/checkpoint/damaged_resume_script.py SAVE_DIR OUT DAMAGE_AT

Trains the toy MLP for `TOTAL_STEPS` with `checkpoint: {auto_resume, save_dir, save_interval,
skip_damaged}`. On the first attempt, right after step DAMAGE_AT + 1, rank 1 truncates its shard
of checkpoint `global_step<DAMAGE_AT>` and kills itself (SIGKILL); the agent restarts both
ranks, `initialize()` skips the damaged tag (one warning) and resumes from the one before it;
rank 0 writes the final parameters and the last loss to OUT. Each attempt appends "attempt <n>
started at step <s>" to OUT + ".log". Self-contained: it runs from its own directory.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

TOTAL_STEPS, SAVE_INTERVAL = 10, 2


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))


def config(save_dir: str | None) -> dict:
    checkpoint = ({"auto_resume": True, "save_dir": save_dir, "save_interval": SAVE_INTERVAL, "skip_damaged": True}
                  if save_dir else {})
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "checkpoint": checkpoint,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.01}},
            "zero_optimization": {"stage": 2}}


def train(save_dir: str | None, damage_at: int | None, log: str | None = None) -> tuple[dict[str, torch.Tensor], float]:
    import zerodist
    import zerodist.comm as comm
    from zerodist.models import make_mlp

    torch.set_num_threads(1)  # bitwise comparable with the reference, whatever the core count
    engine, _, loader, _ = zerodist.initialize(model=make_mlp(), config=config(save_dir), training_data=dataset())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if log and comm.get_rank() == 0:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"attempt {attempt} started at step {engine.global_steps}\n")
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    loss = torch.tensor(0.0)
    while engine.global_steps < TOTAL_STEPS:
        x, y = next(batches)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if attempt == 0 and comm.get_rank() == 1 and damage_at is not None and engine.global_steps == damage_at + 1:
            assert save_dir is not None
            shard = next((Path(save_dir) / f"global_step{damage_at}").glob("shard-r00001-*.bin"))
            os.truncate(shard, shard.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    return engine.module_state_dict(), loss.item()


def main() -> None:
    save_dir, out, damage_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state, loss = train(save_dir, damage_at, log=out + ".log")
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": state, "loss": loss}, out)


if __name__ == "__main__":
    main()
