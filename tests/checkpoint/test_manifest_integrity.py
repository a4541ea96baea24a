"""The manifest carries its own checksum: a changed byte that is still valid JSON (an offset
shifted by 4: a silently wrong resume before) is a named error on every rank, `inspect` exits 1,
and a damaged newest tag names the newest intact one and how to resume from it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import zerodist
import zerodist.checkpoint as ckpt
import zerodist.comm as comm
from tests.engine_helpers import base_config, global_batch
from tests.harness import run_distributed
from zerodist.checkpoint.manifest import Manifest, list_checkpoints
from zerodist.models import make_mlp


def _engine(**checkpoint):
    torch.manual_seed(0)
    engine, *_ = zerodist.initialize(model=make_mlp(), config=base_config(2, checkpoint=checkpoint))
    return engine


def save_body(save_dir: str, steps: int) -> None:
    engine = _engine()
    n, rank = comm.get_world_size(), comm.get_rank()
    for step in range(steps):
        x, y = global_batch(step, 4 * n)
        engine.backward(F.mse_loss(engine(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]))
        engine.step()
        engine.save_checkpoint(save_dir)
    engine.destroy()


def load_body(save_dir: str, tag: str | None = None, skip_damaged: bool = False) -> str:
    """The tag loaded, or the error (caught, so that the worker pool lives on)."""
    engine = _engine(skip_damaged=skip_damaged)
    try:
        return os.path.basename(engine.load_checkpoint(save_dir, tag=tag)[0])
    except ckpt.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        engine.destroy()


def _shift_an_offset(manifest_path) -> None:
    """What the fault probe did: one optimizer offset 4 bytes on, still valid JSON."""
    body = json.loads(manifest_path.read_text())
    entry = next(iter(body["params"].values()))["kinds"]["optimizer.exp_avg"]["slices"][0]
    entry[3] += 4
    manifest_path.write_text(json.dumps(body, indent=1))


def test_every_change_to_a_manifest_is_caught(tmp_path):
    manifest = Manifest(tag="t", global_steps=5, world_size=2, stage=2, precision="fp32", param_dtype="float32",
                        committed_at=1.0, versions={}, files={}, state_files={0: "s0"},
                        params={"w": {"shape": [2, 3], "kinds": {"param": {"dtype": "float32",
                                                                            "slices": [[0, 6, "f", 0]]}}}},
                        extra={}, aliases={}, state_dict_keys=["w"])
    text = manifest.to_json()
    assert Manifest.from_json(text, tmp_path) == manifest
    shifted = json.loads(text)
    shifted["params"]["w"]["kinds"]["param"]["slices"][0][3] = 4  # an offset 4 bytes on: still valid JSON
    with pytest.raises(ckpt.CheckpointCorruptError, match="damaged, CRC-32"):
        Manifest.from_json(json.dumps(shifted, indent=1), tmp_path)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"unknown key\(s\) \['checksuM'\]"):
        Manifest.from_json(text.replace('"checksum"', '"checksuM"'), tmp_path)
    body = json.loads(text)
    del body["checksum"]  # written before manifests had a checksum: read as before
    assert Manifest.from_json(json.dumps(body), tmp_path) == manifest


def test_a_damaged_newest_manifest_fails_every_rank_naming_the_intact_one(tmp_path, capsys):
    from zerodist.cli.main import main

    run_distributed(save_body, 2, str(tmp_path), 2)
    _shift_an_offset(tmp_path / "global_step2" / "manifest.json")
    for message in run_distributed(load_body, 2, str(tmp_path)):
        assert message.startswith("CheckpointCorruptError: the newest checkpoint in"), message
        assert "global_step2: " in message and "damaged, CRC-32" in message
        assert "newest intact checkpoint is global_step1 (step 1)" in message and "skip_damaged" in message
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED (manifest)" in out and "global_step2: " in out
    # the two ways to resume from the intact one
    assert run_distributed(load_body, 2, str(tmp_path), "global_step1") == ["global_step1"] * 2
    assert run_distributed(load_body, 2, str(tmp_path), None, True) == ["global_step1"] * 2


def test_an_older_damaged_manifest_does_not_block_the_newest(tmp_path):
    run_distributed(save_body, 2, str(tmp_path), 2)
    (tmp_path / "global_step1" / "manifest.json").write_text("{")
    assert set(list_checkpoints(tmp_path).damaged) == {"global_step1"}
    assert run_distributed(load_body, 2, str(tmp_path)) == ["global_step2"] * 2


def test_latest_naming_no_committed_tag_is_said_as_such(tmp_path, caplog):
    import logging

    for tag, steps in (("global_step350", 350),):
        (tmp_path / tag).mkdir()
        manifest = Manifest(tag=tag, global_steps=steps, world_size=1, stage=0, precision="fp32",
                            param_dtype="float32", committed_at=1.0, versions={}, files={}, state_files={0: "s"},
                            params={}, extra={}, aliases={}, state_dict_keys=[])
        (tmp_path / tag / "manifest.json").write_text(manifest.to_json())
    (tmp_path / "latest").write_text("global_step999")
    logger = logging.getLogger("zerodist")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="zerodist"):
            assert ckpt.latest_tag(tmp_path) == "global_step350"
    finally:
        logger.removeHandler(caplog.handler)
    # it was "latest names global_step999, but global_step350 was committed after it": neither was true
    assert "latest names global_step999, which is not a committed checkpoint (no such tag)" in caplog.text
    assert "committed after it" not in caplog.text
