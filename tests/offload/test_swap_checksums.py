"""Swap files are checksummed per block ([Note: swap checksums] in zerodist/offload/swap_files.py):
a same-size overwrite, a bit flip and two swapped files are each a `SwapChecksumError` at the next
read, on every rank, and a checkpoint save after the damage commits nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.offload import offload_restart_script as script
from zerodist.offload import SwapChecksumError, SwapDirectory
from zerodist.offload.swap_files import _BLOCK


def _damage(directory: SwapDirectory, how: str) -> None:
    """Change sub-group 1's file (and 0's, for "swap") behind the directory's back."""
    victim = directory.file(1)
    if how == "zeros":  # the same size, other bytes
        victim.write_bytes(bytes(victim.stat().st_size))
    elif how == "flip":
        with open(victim, "r+b") as file:
            file.seek(5)
            byte = file.read(1)[0]
            file.seek(5)
            file.write(bytes([byte ^ 0x10]))
    else:  # the two files swapped
        other = directory.file(0)
        os.rename(victim, str(victim) + ".tmp")
        os.rename(other, victim)
        os.rename(str(victim) + ".tmp", other)


def _filled(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.unit
@pytest.mark.parametrize("how", ["zeros", "flip", "swap"])
def test_changed_swap_file_is_a_checksum_error_at_the_next_read(tmp_path, how):
    directory = SwapDirectory(tmp_path, "run", 0)
    numel = 3 * _BLOCK // 4 + 100  # three blocks and a bit
    for index in (0, 1):
        directory.write(index, _filled(numel, index))
    _damage(directory, how)
    out = torch.empty(numel)
    with pytest.raises(SwapChecksumError, match=r"subgroup00001.swp' changed since this engine wrote it: "
                                                r"bytes 0-1048576 have crc32"):
        directory.read(1, out)
    with pytest.raises(SwapChecksumError):  # a part of the file, in the damaged block
        directory.read(1, out[:10], offset=4, whole=False)
    if how == "flip":  # a block the damage missed reads fine
        directory.read(1, out[:100], offset=_BLOCK, whole=False)
    directory.close()


@pytest.mark.unit
def test_checksums_off_reads_whatever_the_file_holds(tmp_path):
    """What the checksums add: without them a same-size overwrite reads back silently."""
    directory = SwapDirectory(tmp_path, "run", 0)
    directory.checksums = False
    directory.write(1, _filled(1000, 1))
    _damage(directory, "zeros")
    out = torch.empty(1000)
    directory.read(1, out)
    assert not out.any()
    directory.close()


@pytest.mark.unit
def test_partial_reads_and_writes_keep_the_sums_true(tmp_path):
    directory = SwapDirectory(tmp_path, "run", 0)
    numel = 3 * _BLOCK // 4 + 100
    expected = _filled(numel, 0)
    directory.write(0, expected)
    patch = _filled(_BLOCK // 4 + 7, 1)  # straddles a block boundary, starts inside a block
    start = _BLOCK // 4 - 3
    directory.write_at(0, patch, start * 4)
    expected[start: start + patch.numel()] = patch
    directory.write_at(0, _filled(50, 2), numel * 4)  # grows the file
    expected = torch.cat([expected, _filled(50, 2)])
    out = torch.empty(expected.numel())
    directory.read(0, out)
    assert torch.equal(out, expected)
    piece = torch.empty(_BLOCK // 4)
    directory.read(0, piece, offset=(start - 5) * 4, whole=False)
    assert torch.equal(piece, expected[start - 5: start - 5 + piece.numel()])
    assert directory.counters.reads == 2 and directory.counters.writes == 3  # the merges' reads are not counted
    directory.close()


def _damage_then_save_and_step(save_dir: str, nvme_path: str, how: str) -> tuple[str, str]:
    import zerodist
    from zerodist.checkpoint import CheckpointWriteError
    from zerodist.models import make_mlp
    from tests.offload.test_offload_resume import _steps

    engine = zerodist.initialize(model=make_mlp(), config=script.config(None, nvme_path))[0]
    _steps(engine, 0, 2)
    if engine.global_rank == 1:
        engine.zero_state.inner_optimizer.settle()  # the last step's writes land before the damage
        _damage(engine.zero_state.inner_optimizer.directory, how)
    try:
        engine.save_checkpoint(save_dir, tag="after-damage")
    except CheckpointWriteError as error:
        saved = str(error)
    else:
        raise AssertionError("the save after the damage succeeded")
    try:
        _steps(engine, 2, 3)
    except SwapChecksumError as error:
        return saved, str(error)
    finally:
        engine.destroy()
    raise AssertionError("the step after the damage succeeded")


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["zeros", "flip", "swap"])
def test_damaged_swap_file_fails_the_save_and_the_step_on_every_rank(tmp_path, how):
    (tmp_path / "nvme").mkdir()
    results = run_distributed(_damage_then_save_and_step, 2, str(tmp_path / "ckpt"), str(tmp_path / "nvme"), how,
                              timeout=90)
    for saved, stepped in results:
        assert "committed nothing" in saved and "SwapChecksumError" in saved and "subgroup0000" in saved
        assert "changed since this engine wrote it" in stepped
    assert results[0][1].startswith("on rank 1: swap file")
    assert not (Path(tmp_path / "ckpt") / "after-damage").exists()
