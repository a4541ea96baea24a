"""Checkpoints at the same world size: exact resume, load flags, intervals, and every failure
a save or load can meet (ranks that disagree or do not all call save, write errors, damaged
or uncommitted checkpoints), each a clear error with the previous checkpoint intact."""

from __future__ import annotations

import errno
import logging
import os
import random
import re

import numpy as np
import pytest
import torch

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.harness import run_distributed
from zerodist.data import TokenDataset
from zerodist.models import GPT, GPTConfig

pytestmark = pytest.mark.multiprocess

SEQ = 32


def gpt_engine(stage: int, precision: str = "fp32", **checkpoint):
    """A GPT with dropout and tied embeddings, fed by the engine's loader: gas 2, a schedule,
    fp16 loss scale that moves every 2 steps; everything a resume must restore."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, dropout=0.1, tie_embeddings=True))
    corpus = torch.randint(0, 256, (24 * SEQ + 1,), generator=torch.Generator().manual_seed(3))
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
        "checkpoint": checkpoint,
    }
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"loss_scale_window": 2, "initial_scale_power": 8}
                                                  if precision == "fp16" else {})}
    engine, _, loader, _ = zerodist.initialize(model=model, config=config, training_data=TokenDataset(corpus, SEQ))
    return engine, loader


def endless(loader):
    while True:
        yield from loader


def train_until(engine, batches, steps: int) -> None:
    """Steps drawing on every RNG a training script may use (dropout; Python and numpy here)."""
    while engine.global_steps < steps:
        x, y = next(batches)
        weight = 1.0 + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        engine.backward(engine(x, y) * weight)
        engine.step()


def snapshot(engine) -> dict:
    inner = engine.optimizer.inner
    return {
        "params": engine.module_state_dict(),
        "stepped": [t.detach().clone() for g in engine.groups for t in g.optimizer_tensors],
        "state": [{k: v.clone() for k, v in inner.state[t].items()} for g in engine.groups for t in g.optimizer_tensors],
        "lr": engine.get_lr(), "scale": engine.loss_scale, "loader": engine.training_dataloader.state_dict(),
        "steps": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
    }


def assert_same(got, expected, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), f"{path} differs"
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    else:
        assert got == expected, f"{path}: {got} != {expected}"


def exact_resume_body(save_dir: str, stage: int, precision: str) -> None:
    random.seed(0), np.random.seed(0)
    engine, loader = gpt_engine(stage, precision)
    batches = endless(loader)
    train_until(engine, batches, 4)  # 16 of 24 windows per epoch... mid-epoch (6 micro-batches/epoch/rank)
    engine.save_checkpoint(save_dir, client_state={"note": "mid-epoch", "step": 4})
    train_until(engine, batches, 7)  # crosses an epoch boundary
    expected = snapshot(engine)
    engine.destroy()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the resumed run must not depend on these
    resumed, loader = gpt_engine(stage, precision)
    path, client_state = resumed.load_checkpoint(save_dir)
    assert path.endswith("global_step4") and client_state == {"note": "mid-epoch", "step": 4}
    train_until(resumed, endless(loader), 7)
    assert_same(snapshot(resumed), expected)


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (1, "fp16"),
                                             (3, "fp32"), (3, "bf16")])
def test_resume_is_bitwise_identical_to_a_run_that_never_stopped(tmp_path, stage, precision):
    run_distributed(exact_resume_body, 2, str(tmp_path), stage, precision)


def load_flags_body(save_dir: str) -> None:
    engine, loader = gpt_engine(2)
    train_until(engine, endless(loader), 2)
    engine.save_checkpoint(save_dir, tag="mine", client_state=[1, 2])
    saved = engine.module_state_dict()
    module_only, _ = gpt_engine(2)
    assert module_only.load_checkpoint(save_dir, load_module_only=True)[1] == [1, 2]
    assert_same(module_only.module_state_dict(), saved)
    assert module_only.global_steps == 0 and not module_only.optimizer.inner.state
    fresh_optimizer, _ = gpt_engine(2)
    fresh_optimizer.load_checkpoint(save_dir, tag="mine", load_optimizer_states=False)
    assert fresh_optimizer.global_steps == 2 and not fresh_optimizer.optimizer.inner.state
    assert fresh_optimizer.get_lr() == engine.get_lr()
    empty_dir = os.path.join(save_dir, "nothing-here")
    assert fresh_optimizer.load_checkpoint(empty_dir) == (None, None)


def test_load_flags_client_state_and_an_empty_directory(tmp_path):
    run_distributed(load_flags_body, 2, str(tmp_path))


def interval_body(save_dir: str) -> list[str]:
    engine, loader = gpt_engine(1, save_interval=2, keep_last=2, save_dir=save_dir)
    train_until(engine, endless(loader), 7)
    return [m.tag for m in ckpt.list_checkpoints(save_dir).committed]


def test_save_interval_keeps_the_last_n(tmp_path):
    tags = run_distributed(interval_body, 2, str(tmp_path))[0]
    assert tags == ["global_step4", "global_step6"]
    assert (tmp_path / "latest").read_text() == "global_step6"


def tag_body(save_dir: str, policy: str) -> str:
    engine, _ = gpt_engine(0, tag_validation=policy)
    tag = f"rank{comm.get_rank()}"
    if policy == "Fail":
        with pytest.raises(ckpt.CheckpointAgreementError, match=r"different tags \(rank 0: 'rank0', rank 1: 'rank1'\)"):
            engine.save_checkpoint(save_dir, tag=tag)
        return ""
    return os.path.basename(engine.save_checkpoint(save_dir, tag=tag))


def test_ranks_with_different_tags_fail_or_use_rank0s(tmp_path):
    run_distributed(tag_body, 2, str(tmp_path / "fail"), "Fail")
    assert not (tmp_path / "fail").exists()
    assert run_distributed(tag_body, 2, str(tmp_path / "warn"), "Warn") == ["rank0", "rank0"]


def some_ranks_body(save_dir: str) -> None:
    engine, _ = gpt_engine(0, agreement_timeout=2)
    if comm.get_rank() == 0:
        with pytest.raises(ckpt.CheckpointAgreementError, match=r"rank\(s\) \[1\] did not reach '[\w-]+' call #\d+ within 2 s"):
            engine.save_checkpoint(save_dir)
    comm.barrier()
    if comm.get_rank() == 1:  # arriving late, it fails at once instead of waiting for rank 0
        with pytest.raises(ckpt.CheckpointAgreementError, match="after the others gave up"):
            engine.save_checkpoint(save_dir)
    comm.barrier()


def test_save_called_on_some_ranks_only_fails_there_not_hangs(tmp_path):
    # Rank 0 names rank 1 "within 2 s" (the agreement timeout, not the collective timeout's 60 s, which
    # would still fit under the harness's deadline) and rank 1 "after the others gave up" at once.
    run_distributed(some_ranks_body, 2, str(tmp_path))
    assert not any(tmp_path.iterdir())


def write_failure_body(save_dir: str, where: str) -> None:
    engine, loader = gpt_engine(2)
    batches = endless(loader)
    train_until(engine, batches, 2)
    engine.save_checkpoint(save_dir)
    saved = engine.module_state_dict()
    train_until(engine, batches, 4)
    patch_target, attribute = {"shard": (ckpt.files.AtomicFile, "write"), "latest": (ckpt.save, "write_latest")}[where]
    original = getattr(patch_target, attribute)

    def failing(*args, **kwargs):
        if where == "shard" and comm.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        if where == "latest":
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(save_dir, "latest"))
        return original(*args, **kwargs)

    setattr(patch_target, attribute, failing)
    try:
        if where == "latest":  # the new checkpoint is complete: kept (with a warning), never rolled back
            engine.save_checkpoint(save_dir)
        else:
            with pytest.raises(ckpt.CheckpointWriteError, match=r"rank 1: OSError: \[Errno 28\] No space left"):
                engine.save_checkpoint(save_dir)
    finally:
        setattr(patch_target, attribute, original)
    if where == "latest":
        assert [m.tag for m in ckpt.list_checkpoints(save_dir).committed] == ["global_step2", "global_step4"]
        assert ckpt.list_checkpoints(save_dir).latest == "global_step2"
        reloaded, _ = gpt_engine(2)
        assert reloaded.load_checkpoint(save_dir)[0].endswith("global_step4")
        assert_same(reloaded.module_state_dict(), engine.module_state_dict())
        return
    assert [m.tag for m in ckpt.list_checkpoints(save_dir).committed] == ["global_step2"]
    assert not os.path.exists(os.path.join(save_dir, "global_step4"))
    reloaded, _ = gpt_engine(2)
    assert reloaded.load_checkpoint(save_dir)[0].endswith("global_step2")
    assert_same(reloaded.module_state_dict(), saved)


@pytest.mark.parametrize("where", ["shard", "latest"])
def test_write_failure_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, where):
    run_distributed(write_failure_body, 2, str(tmp_path), where)


def save_body(save_dir: str, steps: int, stage: int = 2) -> dict[str, torch.Tensor]:
    engine, loader = gpt_engine(stage)
    batches = endless(loader)
    for step in range(1, steps + 1):
        train_until(engine, batches, step)
        engine.save_checkpoint(save_dir)
    return engine.module_state_dict()


def load_body(save_dir: str, tag: str | None = None) -> str:
    """The tag loaded, or the error's message (caught here, so the worker pool lives on)."""
    engine, _ = gpt_engine(2)
    try:
        return os.path.basename(engine.load_checkpoint(save_dir, tag=tag)[0])
    except ckpt.CheckpointError as err:
        return f"{type(err).__name__}: {err}"


def test_damaged_shards_are_reported_by_file_name(tmp_path, capsys):
    from zerodist.cli.main import main

    run_distributed(save_body, 2, str(tmp_path), 1)
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    assert re.search(r"global_step1 +1 +2 +2 +fp32 +\S+ +4 .* ok$", capsys.readouterr().out, re.M)
    shard = next((tmp_path / "global_step1").glob("shard-r00001-*.bin"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    for message in run_distributed(load_body, 2, str(tmp_path)):  # every rank fails, naming the file
        assert message.startswith("CheckpointCorruptError") and f"{shard.name}: corrupt, CRC-32" in message
    shard.write_bytes(bytes(data[:50]))
    for message in run_distributed(load_body, 2, str(tmp_path)):
        assert f"{shard.name}: truncated, 50 bytes instead of {len(data)}" in message
    (report,), _ = ckpt.inspect_checkpoints(tmp_path)
    assert report.problems and shard.name in report.problems[0]
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 1
    assert "DAMAGED (1 file(s))" in capsys.readouterr().out
    with pytest.raises(ckpt.CheckpointCorruptError, match=shard.name):
        ckpt.consolidate_checkpoint(tmp_path)


def test_uncommitted_tags_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    run_distributed(save_body, 2, str(tmp_path), 2)
    (tmp_path / "global_step2" / "manifest.json").unlink()  # as if the save had died before its commit
    (tmp_path / "global_step9").mkdir()
    with caplog.at_level(logging.WARNING, logger="zerodist"):
        logging.getLogger("zerodist").addHandler(caplog.handler)
        try:
            assert ckpt.latest_tag(tmp_path) == "global_step1"
        finally:
            logging.getLogger("zerodist").removeHandler(caplog.handler)
    assert "skipping checkpoint global_step2" in caplog.text and "skipping checkpoint global_step9" in caplog.text
    assert run_distributed(load_body, 2, str(tmp_path)) == ["global_step1"] * 2
    for message in run_distributed(load_body, 2, str(tmp_path), "global_step2"):
        assert "no committed checkpoint 'global_step2'" in message and "committed tags: global_step1" in message
