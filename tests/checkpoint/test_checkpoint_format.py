"""The checkpoint format's pure parts, in one process: atomic files, checksums, the manifest,
tag listing, the safetensors writer, the resumable data loader, and the crash points."""

from __future__ import annotations

import json

import pytest
import torch

import zerodist.checkpoint as ckpt
from tests.harness import run_distributed
from zerodist.checkpoint.files import AtomicFile, file_problem
from zerodist.checkpoint.manifest import Manifest, check_tag_name, list_checkpoints
from zerodist.config import Config, ConfigError
from zerodist.engine.dataloader import EngineDataLoader


@pytest.mark.unit
def test_atomic_file_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "data.bin"
    with pytest.raises(RuntimeError):
        with AtomicFile(target) as f:
            f.write(b"half")
            raise RuntimeError("crash before commit")
    assert list(tmp_path.iterdir()) == []
    with AtomicFile(target) as f:
        assert f.write(b"abc") == 0 and f.write(memoryview(b"defg")) == 3
        f.commit()
    assert target.read_bytes() == b"abcdefg" and list(tmp_path.iterdir()) == [target]
    assert file_problem(target, 7, f.checksum) is None
    assert "truncated, 7 bytes instead of 9" in file_problem(target, 9, f.checksum)
    assert "corrupt, CRC-32" in file_problem(target, 7, "00000000")
    assert file_problem(tmp_path / "gone", 7, f.checksum).endswith("gone: missing")


def _manifest(tag: str, steps: int, committed_at: float) -> Manifest:
    return Manifest(tag=tag, global_steps=steps, world_size=2, stage=2, precision="fp32", param_dtype="float32",
                    committed_at=committed_at, versions={}, files={}, state_files={0: "s0", 1: "s1"},
                    params={"w": {"shape": [2, 3], "kinds": {"param": {"dtype": "float32", "slices": [[0, 6, "f", 0]]}}}},
                    extra={}, aliases={}, state_dict_keys=["w"])


@pytest.mark.unit
def test_manifest_round_trip_and_damage(tmp_path):
    m = _manifest("t", 5, 1.0)
    back = Manifest.from_json(m.to_json(), tmp_path)
    assert back == m and back.num_params == 6
    with pytest.raises(ckpt.CheckpointCorruptError, match="not valid JSON"):
        Manifest.from_json(m.to_json()[:40], tmp_path)
    body = json.loads(m.to_json())
    body["version"] = 99
    with pytest.raises(ckpt.CheckpointCorruptError, match="format version 99"):
        Manifest.from_json(json.dumps(body), tmp_path)


@pytest.mark.unit
def test_listing_orders_committed_tags_and_names_incomplete_ones(tmp_path):
    for tag, steps, when in (("b", 6, 2.0), ("a", 3, 1.0)):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "manifest.json").write_text(_manifest(tag, steps, when).to_json())
    (tmp_path / "c").mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "manifest.json").write_text("{")
    (tmp_path / "latest").write_text("a")
    listing = list_checkpoints(tmp_path)
    assert [m.tag for m in listing.committed] == ["a", "b"] and listing.latest == "a"
    assert set(listing.incomplete) == {"c", "d"} and "not valid JSON" in listing.incomplete["d"]
    with pytest.raises(ckpt.CheckpointCorruptError, match="newest intact checkpoint is b"):
        ckpt.latest_tag(tmp_path)  # d's manifest is damaged, and may be newer than b: never skipped silently
    (tmp_path / "d" / "manifest.json").unlink()
    assert ckpt.latest_tag(tmp_path) == "b"  # committed after the one `latest` names
    assert list_checkpoints(tmp_path / "missing").committed == []


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["latest", "a/b", ".hidden", ""])
def test_tag_names_must_be_plain_directory_names(bad):
    with pytest.raises(ValueError, match="plain directory name"):
        check_tag_name(bad)


@pytest.mark.unit
def test_safetensors_writer_is_read_by_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = {"w": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7),
             "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 2)}
    ckpt.write_safetensors(state, tmp_path / "x.safetensors", {"tag": "t"})
    back = safetensors.load_file(tmp_path / "x.safetensors")
    assert set(back) == set(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def _epoch(loaders) -> list[list[int]]:
    """One epoch's global batches (the union of every rank's batch, step by step)."""
    return [sorted(int(v) for batch in step for v in batch[0].reshape(-1)) for step in zip(*loaders)]


@pytest.mark.unit
@pytest.mark.parametrize("resume_ranks", [2, 4])
def test_loader_resumes_mid_epoch_with_the_same_global_batches(resume_ranks):
    data = torch.utils.data.TensorDataset(torch.arange(48.0).unsqueeze(1))  # 4 global batches of 12 per epoch
    make = lambda ranks: [EngineDataLoader(data, batch_size=12 // ranks, num_replicas=ranks, rank=r) for r in range(ranks)]
    loaders = make(2)
    uninterrupted = [_epoch(loaders), _epoch(loaders)]
    assert uninterrupted[0] != uninterrupted[1]
    interrupted = make(2)
    for it in [iter(loader) for loader in interrupted]:
        next(it)  # one global batch into epoch 0
    state = interrupted[0].state_dict()
    assert state == {"epoch": 0, "samples_in_epoch": 12}
    resumed = make(resume_ranks)
    for loader in resumed:
        loader.load_state_dict(state)
    assert _epoch(resumed) == uninterrupted[0][1:]
    assert _epoch(resumed) == uninterrupted[1]
    assert resumed[0].state_dict() == {"epoch": 2, "samples_in_epoch": 0}


@pytest.mark.unit
def test_auto_resume_and_save_interval_need_a_save_dir():
    with pytest.raises(ConfigError, match=r"'checkpoint.save_interval' is set but 'checkpoint.save_dir' is not"):
        Config.load({"checkpoint": {"save_interval": 5}})
    assert Config.load({"checkpoint": {"auto_resume": True, "save_dir": "x"}}).checkpoint.auto_resume


def trace_points_body(save_dir: str) -> list[str]:
    import zerodist
    from tests.engine_helpers import base_config
    from zerodist.checkpoint import files, save
    from zerodist.models import make_mlp

    engine, *_ = zerodist.initialize(model=make_mlp(), config=base_config(1, checkpoint={"keep_last": 1,
                                                                                          "save_dir": save_dir}))
    seen: list[str] = []
    original = files.kill_point
    record = lambda name: (seen.append(name), original(name))
    save.kill_point = files.kill_point = record
    try:
        engine.save_checkpoint(save_dir, tag="a")
        engine.save_checkpoint(save_dir, tag="b")  # prunes "a": the clean-up points run
    finally:
        save.kill_point = files.kill_point = original
    return seen


@pytest.mark.multiprocess
def test_a_save_passes_every_crash_point_in_order(tmp_path):
    seen = run_distributed(trace_points_body, 1, str(tmp_path))[0]
    second = seen[seen.index("save-done") + 1:]
    assert list(dict.fromkeys(second)) == list(ckpt.KILL_POINTS)  # every point, first passed in this order
