"""kill -9 of a rank in the middle of a swapped optimizer step, then an automatic restart.

    python -m zerodist run --nproc 2 --max-restarts 1 tests/offload/offload_restart_script.py \
        SAVE_DIR NVME_PATH OUT KILL_AT

Trains the toy MLP at stage 2 with `offload_optimizer: nvme` (sub-groups of 256 elements: four
per rank) and a checkpoint every 2 steps. On the first attempt rank 1 kills itself (SIGKILL)
during step KILL_AT + 1, after it wrote its second sub-group back, so its swap files hold half a
step; the elastic agent restarts both ranks, `initialize()` resumes from the newest committed
checkpoint (which rebuilds the swap files in a new run directory) and rank 0 writes the final
parameters to OUT. Self-contained: the script runs from its own directory, outside the test package.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

TOTAL_STEPS, SAVE_INTERVAL = 8, 2


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))


def config(save_dir: str | None, nvme_path: str | None) -> dict:
    checkpoint = {"auto_resume": True, "save_dir": save_dir, "save_interval": SAVE_INTERVAL} if save_dir else {}
    zero: dict = {"stage": 2, "sub_group_size": 256}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                                     "pipeline_write": True}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "checkpoint": checkpoint,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": zero}


def train(save_dir: str | None, nvme_path: str | None, kill_at: int | None) -> dict[str, torch.Tensor]:
    import zerodist
    import zerodist.comm as comm
    from zerodist.models import make_mlp

    torch.set_num_threads(1)  # bitwise comparable with the reference, whatever the core count
    engine, _, loader, _ = zerodist.initialize(model=make_mlp(), config=config(save_dir, nvme_path),
                                               training_data=dataset())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 and comm.get_rank() == 1 and kill_at is not None:
        _kill_mid_step(engine, kill_at)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    while engine.global_steps < TOTAL_STEPS:
        x, y = next(batches)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    state = engine.module_state_dict()
    engine.destroy()
    return state


def _kill_mid_step(engine: object, kill_at: int) -> None:
    directory = engine.zero_state.inner_optimizer.directory  # type: ignore[attr-defined]
    write, written = directory.write, []

    def write_then_die(index: int, data: torch.Tensor) -> None:
        write(index, data)
        if engine.global_steps == kill_at:  # type: ignore[attr-defined]  # inside step kill_at + 1
            written.append(index)
            if len(written) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    directory.write = write_then_die


def main() -> None:
    save_dir, nvme_path, out, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    state = train(save_dir, nvme_path, kill_at)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(state, out)


if __name__ == "__main__":
    main()
