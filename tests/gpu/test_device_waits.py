"""Where a ZeRO step waits for the GPU: torch's sync debug mode counts every operation that makes the
host wait for the device during one optimizer step (two micro-batches, gradient clipping, bf16) at one
rank on NCCL. The first GPU run (H200, docs/gpu.md) counted two at stages 1-3 (the step's one
all-reduce of norm, overflow and check digests: built from host numbers, read back with `.tolist()`)
and three at stage 0; each wait more stops the host from queueing work ahead of the device."""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.gpu

MOST_WAITS = {0: 3, 1: 2, 2: 2, 3: 2}


def _waits_in_one_step(stage: int) -> dict:
    import zerodist
    import zerodist.comm as comm
    from zerodist.models import GPT, gpt_config

    device = comm.device_for_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}}
    torch.manual_seed(0)
    engine = zerodist.initialize(model=GPT(gpt_config("tiny")), config=config)[0]
    tokens = torch.randint(0, 256, (2, engine.module.config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)

    def step() -> None:
        for _ in range(2):
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    places: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}zerodist{os.sep}" in f.filename]
        places.append(f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}" if frames else f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    engine.destroy()
    return {"backend": comm.ensure_initialized().backend, "places": places}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_waits_for_the_device_only_for_its_one_all_reduce(stage):
    result = run_distributed(_waits_in_one_step, 1, stage, timeout=180, backend="nccl")[0]
    assert result["backend"] == "nccl"
    waits = Counter(result["places"])
    assert len(result["places"]) <= MOST_WAITS[stage], (
        f"stage {stage}: {len(result['places'])} waits for the device in one step (at most {MOST_WAITS[stage]}): "
        + "; ".join(f"{n} x {place}" for place, n in waits.most_common()))
