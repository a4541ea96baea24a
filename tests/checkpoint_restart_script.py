"""A training script for the automatic-restart test (run by `zerodist run --max-restarts 1`).

    python -m zerodist run --nproc 2 --max-restarts 1 tests/checkpoint_restart_script.py SAVE_DIR OUT [KILL_AT [damage]]

Trains the toy MLP for `TOTAL_STEPS` on a fixed dataset through the engine's data loader, with
`checkpoint: {auto_resume, save_dir, save_interval, skip_damaged}`. On the first attempt, rank 1
kills itself (SIGKILL) right after step KILL_AT; with `damage` it first truncates its shard of the
newest checkpoint. The elastic agent restarts both ranks, `initialize()` resumes from the newest
committed (intact) checkpoint, and rank 0 finally writes the parameters and the last loss to OUT.
Each attempt appends "attempt <n> started at step <s>" to OUT + ".log".
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


def train(save_dir: str | None, kill_at: int | None, log: str | None = None,
          damage: bool = False) -> tuple[dict[str, torch.Tensor], float]:
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
        if attempt == 0 and comm.get_rank() == 1 and engine.global_steps == kill_at:
            if damage:  # rank 1's shard of the newest checkpoint cut in half
                assert save_dir is not None and kill_at is not None
                newest = Path(save_dir) / f"global_step{kill_at - kill_at % SAVE_INTERVAL}"
                shard = next(newest.glob("shard-r00001-*.bin"))
                os.truncate(shard, shard.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    return engine.module_state_dict(), loss.item()


def main() -> None:
    save_dir, out = sys.argv[1], sys.argv[2]
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    state, loss = train(save_dir, kill_at, log=out + ".log", damage=sys.argv[4:5] == ["damage"])
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": state, "loss": loss}, out)


if __name__ == "__main__":
    main()
