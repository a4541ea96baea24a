"""DeepSpeed's csv_monitor, tensorboard, wandb and comet sections are honoured, not ignored: each
is read back from what it wrote (W&B's offline run file, Comet's offline experiment archive)."""

from __future__ import annotations

import contextlib
import csv
import glob
import importlib.util
import json
import os
import struct
import tempfile
import zipfile
from collections.abc import Iterator

import pytest
import torch.nn.functional as F

import zerodist
import zerodist.comm as comm
from zerodist.engine.monitor import TensorboardMonitor
from zerodist.models import make_mlp
from tests.engine_helpers import base_config, global_batch
from tests.harness import distributed_test


def _train_three_steps(section: str, settings: dict | None = None,
                       env: dict[str, str] | None = None) -> tuple[str | None, list[float], float]:
    """Three steps with the monitor `section` writing under a folder of rank 0's; returns (the
    folder on rank 0, each step's loss averaged over the ranks, the last learning rate). `env`
    (with `{folder}` filled in) is set around the run."""
    box = [tempfile.mkdtemp() if comm.get_rank() == 0 else None]
    comm.broadcast_object_list(box, src=0)
    settings = settings or {"output_path": box[0], "job_name": "job"}
    config = base_config(1, **{section: {"enabled": True, **settings}})
    with _environment({k: v.format(folder=box[0]) for k, v in (env or {}).items()}):
        losses, lr = _three_steps(config)
    return box[0], losses, lr


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _three_steps(config: dict) -> tuple[list[float], float]:
    engine, _, _, _ = zerodist.initialize(model=make_mlp(), config=config)
    rank, losses = comm.get_rank(), []
    for step in range(3):
        x, y = global_batch(step, 8)
        loss = F.mse_loss(engine(x[rank * 4: rank * 4 + 4]), y[rank * 4: rank * 4 + 4])
        mean = loss.detach().clone()
        comm.all_reduce(mean, op=comm.ReduceOp.AVG)
        losses.append(mean.item())
        engine.backward(loss)
        engine.step()
    lr = engine.get_lr()[0]
    engine.destroy()
    return losses, lr


@distributed_test(world_size=2)
def test_csv_monitor_writes_the_mean_loss_per_step():
    folder, losses, _ = _train_three_steps("csv_monitor")
    if comm.get_rank() == 0:
        assert folder is not None
        with open(os.path.join(folder, "job", "Train_Samples_train_loss.csv")) as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", "Train/Samples/train_loss"]
        assert [int(r[0]) for r in rows[1:]] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
        assert os.path.exists(os.path.join(folder, "job", "Train_Samples_lr.csv"))


@distributed_test(world_size=2)
def test_tensorboard_events_read_back_with_deepspeeds_names():
    # TensorBoard's own reader, not a mock (tensorboard is in the test extra)
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    folder, losses, lr = _train_three_steps("tensorboard")
    if comm.get_rank() == 0:
        events = accumulator.EventAccumulator(f"{folder}/job").Reload()
        # DeepSpeed's names; loss_scale only under fp16, as DeepSpeed writes it
        assert set(events.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr"}
        written = events.Scalars("Train/Samples/train_loss")
        assert [e.step for e in written] == [8, 16, 24]  # samples seen, as DeepSpeed counts
        assert [e.value for e in written] == pytest.approx(losses, rel=1e-6)
        assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([lr] * 3)


@pytest.mark.unit
def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(zerodist.ConfigError, match="needs the tensorboard package: pip install tensorboard"):
        TensorboardMonitor("out", "job")


def _wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline W&B run file: a ':W&B' header, then LevelDB's log format
    (32 KiB blocks of records: crc32c, length, type full/first/middle/last) of wandb's protobuf
    Records. The SDK's own reader went with its Go core; this is the format it writes."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, pieces = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        pieces, pos = (b"" if kind in (1, 2) else pieces) + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.slow  # the package's run/experiment start and close: ~20-30 s on 2 loaded cores
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed (pip install 'zerodist[monitors]')")
@distributed_test(world_size=2)
def test_wandb_offline_run_reads_back_with_deepspeeds_names():
    env = {"WANDB_MODE": "offline", "WANDB_DIR": "{folder}", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    folder, losses, lr = _train_three_steps("wandb", {"project": "zerodist-test", "group": "g"}, env)
    if comm.get_rank() == 0:
        import wandb

        wandb.teardown()  # the run's service process ends with the test, not with the worker
        files = glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))
        assert len(files) == 1, files  # one run: rank 0's
        rows = [r for r in _wandb_history(files[0]) if "Train/Samples/train_loss" in r]
        assert [r["_step"] for r in rows] == [8, 16, 24], _wandb_history(files[0])  # samples seen, as DeepSpeed counts
        assert [r["Train/Samples/train_loss"] for r in rows] == pytest.approx(losses, rel=1e-6)
        assert [r["Train/Samples/lr"] for r in rows] == pytest.approx([lr] * 3)
        assert not any("Train/Samples/loss_scale" in r for r in rows)  # fp16 only


@pytest.mark.slow  # the package's run/experiment start and close: ~20-30 s on 2 loaded cores
@pytest.mark.skipif(importlib.util.find_spec("comet_ml") is None,
                    reason="comet_ml is not installed (pip install 'zerodist[monitors]')")
@distributed_test(world_size=2)
def test_comet_offline_experiment_reads_back_every_samples_log_interval():
    settings = {"online": False, "project": "zerodist-test", "experiment_name": "job", "samples_log_interval": 16}
    env = {"COMET_OFFLINE_DIRECTORY": "{folder}", "COMET_DISABLE_AUTO_LOGGING": "1"}
    folder, losses, lr = _train_three_steps("comet", settings, env)
    if comm.get_rank() == 0:
        archives = glob.glob(os.path.join(folder, "*.zip"))
        assert len(archives) == 1, archives  # one experiment: rank 0's
        messages = [json.loads(line) for line in zipfile.ZipFile(archives[0]).read("messages.json").splitlines()]
        metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
        loss = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
        # samples 8, 16, 24: logged at 8, then once 16 more samples have passed (DeepSpeed's scheduler)
        assert [step for step, _ in loss] == [8, 24]
        assert [value for _, value in loss] == pytest.approx([losses[0], losses[2]], rel=1e-6)
        assert [m["metricValue"] for m in metrics if m["metricName"] == "Train/Samples/lr"] == pytest.approx([lr] * 2)


@pytest.mark.unit
@pytest.mark.parametrize(("section", "package"), [("wandb", "wandb"), ("comet", "comet_ml")])
def test_an_enabled_section_without_its_package_is_a_config_error(monkeypatch, section, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(zerodist.ConfigError, match=rf"'{section}.enabled' needs the {package} package.*pip install "
                                                   rf"{package}"):
        zerodist.config.Config.load({"train_micro_batch_size_per_gpu": 1, section: {"enabled": True}})
    zerodist.config.Config.load({"train_micro_batch_size_per_gpu": 1, section: {"enabled": False, "project": "p"}})
