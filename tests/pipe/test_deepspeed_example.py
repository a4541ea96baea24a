"""DeepSpeedExamples' training/pipeline_parallelism/train.py, both of its paths, as a script in our
own words (tests/pipe/deepspeed_pipeline_example.py) run by torchrun with `--backend gloo` under
`import zerodist as deepspeed`: the pipeline path (`train_pipe`: a PipelineModule of a small
AlexNet's layers, a lambda among them, `initialize(args=, model=, model_parameters=,
training_data=)`, `engine.train_batch()` without an iterator) must give the losses of one process
doing gradient accumulation over the same micro-batches; the data-parallel path (`train_base`:
the loader `initialize` returns, `engine(inputs)`, `backward`, `step`) must run on both ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.pipe.deepspeed_pipeline_example import SmallAlexNet, random_images
from tests.processes import run_group
from zerodist.engine.dataloader import EngineDataLoader
from zerodist.runtime.utils import set_random_seed
from zerodist.utils import RepeatingLoader

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "pipe" / "deepspeed_pipeline_example.py"
MICRO, GAS, STEPS, SEED, LR = 4, 4, 5, 1138, 1e-3
CONFIG = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
          # weight_decay spelled out: DeepSpeed's Adam defaults to 0, torch's AdamW (what "Adam" maps to) to 0.01
          "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}}}


def launch(tmp_path: Path, pipeline_size: int) -> list[list[float]]:
    config, results = tmp_path / "ds_config.json", tmp_path / f"losses-{pipeline_size}.json"
    config.write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(SCRIPT), "--deepspeed_config", str(config), "--backend", "gloo",
                     "-p", str(pipeline_size), "--steps", str(STEPS), "--results", str(results)],
                    timeout=240, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(results.read_text())


def one_process_losses() -> list[float]:
    """The same model, seed and loader order, one process, gradient accumulation over GAS micro-batches."""
    torch.manual_seed(SEED)
    set_random_seed(SEED)
    model = SmallAlexNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    # DeepSpeed's pipeline engine reads training_data in order (DistributedSampler(shuffle=False)), repeated.
    batches = iter(RepeatingLoader(EngineDataLoader(random_images(), batch_size=MICRO, num_replicas=1, rank=0,
                                                    shuffle=False)))
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(GAS):
            images, labels = next(batches)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            (loss / GAS).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
    return losses


@pytest.mark.slow  # torchrun and two fresh ranks
def test_the_examples_pipeline_path_equals_one_process(tmp_path):
    first, second = launch(tmp_path, 2)
    assert first == second  # train_batch returns the same loss on both stages
    assert first == pytest.approx(one_process_losses(), rel=1e-5)


@pytest.mark.slow
def test_the_examples_data_parallel_path_runs(tmp_path):
    per_rank = launch(tmp_path, 0)
    # every micro-step of the example's loop ran on both ranks (2 data ranks: accumulation 2)
    assert [len(losses) for losses in per_rank] == [STEPS * 2, STEPS * 2]
    assert all(0 < loss < 10 for losses in per_rank for loss in losses)
