"""The swapped optimizer alone (one process): bitwise the in-memory optimizer, its files, its
counters, its state read back and loaded, and its named errors."""

from __future__ import annotations

import os

import pytest
import torch

from zerodist.offload import (
    ALIGN, StreamSettings, SwapDirectory, SwapFileError, SwapPathError, SwapSpaceError, plan_subgroups, swapped,
)
from zerodist.offload.swap_files import check_swap_root, problem_error

pytestmark = pytest.mark.unit

SIZES = [[3000, 1000], [700, 5000]]  # two param groups of flat shards, as ZeRO builds them


def _tensors(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=generator) for n in group] for group in SIZES]


def _build(tensors: list[list[torch.Tensor]], cls=torch.optim.AdamW, **options) -> torch.optim.Optimizer:
    return cls([{"params": group, "lr": 1e-2 * (i + 1), "weight_decay": 0.1 * i} for i, group in enumerate(tensors)],
               **options)


def _run(optimizer: torch.optim.Optimizer, tensors, steps: int) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        for group in tensors:
            for tensor in group:
                tensor.grad = torch.randn(tensor.numel(), generator=generator)
        optimizer.step()


@pytest.mark.parametrize("sub_group_size,pipeline", [(1000, True), (1000, False), (300, True), (0, False)])
@pytest.mark.parametrize("cls,options", [(torch.optim.AdamW, {}), (torch.optim.Adam, {"fused": True}),
                                         (torch.optim.SGD, {"momentum": 0.9})])
def test_bitwise_equal_to_the_in_memory_optimizer(tmp_path, sub_group_size, pipeline, cls, options):
    reference, offloaded = _tensors(0), _tensors(0)
    plain = _build(reference, cls, **options)
    directory = SwapDirectory(tmp_path, "run", 0)
    optimizer = swapped(_build(offloaded, cls, **options), directory,
                        StreamSettings(sub_group_size, buffer_count=3, pipeline_read=pipeline, pipeline_write=pipeline))
    _run(plain, reference, 4)
    _run(optimizer, offloaded, 4)
    for mine, theirs in zip(sum(offloaded, []), sum(reference, [])):
        assert torch.equal(mine, theirs)
        for key, value in plain.state[theirs].items():
            assert torch.equal(optimizer.state[mine][key], value), key
    # Nothing per-element stays in memory between steps; the files hold it.
    assert not optimizer.inner.state and optimizer.resident_state_bytes() < 100
    assert len(os.listdir(directory.path)) == len(plan_subgroups([[t.numel() for t in g] for g in offloaded],
                                                                  sub_group_size))
    assert type(optimizer).__name__ == cls.__name__  # a checkpoint sees the optimizer class it was built as
    optimizer.close()
    assert not directory.path.exists()


def test_bytes_moved_per_step_are_the_state(tmp_path):
    tensors = _tensors(1)
    directory = SwapDirectory(tmp_path, "run", 0)
    optimizer = swapped(_build(tensors), directory, StreamSettings(1024, pipeline_read=True, pipeline_write=True))
    _run(optimizer, tensors, 1)
    before = directory.counters.snapshot()
    io_before = _proc_io()
    _run(optimizer, tensors, 1)
    optimizer.settle()  # the step's last writes finish after it returns ([Note: swap I/O across steps])
    io_after = _proc_io()
    numel = sum(sum(group) for group in SIZES)
    state_bytes = 2 * 4 * numel  # exp_avg and exp_avg_sq in fp32; regions align to 64 bytes
    read = directory.counters.bytes_read - before.bytes_read
    written = directory.counters.bytes_written - before.bytes_written
    assert read == written == optimizer.swapped_state_bytes()
    assert state_bytes <= read <= state_bytes + 2 * 64 * directory.counters.writes
    # /proc/self/io counts the bytes passed to read/write system calls, this process's own (and a few more).
    assert io_after["rchar"] - io_before["rchar"] >= read and io_after["wchar"] - io_before["wchar"] >= written
    optimizer.close()


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as file:
        return {k: int(v) for k, v in (line.split(": ") for line in file)}


def test_state_dict_round_trip_rebuilds_the_files(tmp_path):
    reference, offloaded, resumed = _tensors(2), _tensors(2), None
    plain = _build(reference)
    optimizer = swapped(_build(offloaded), SwapDirectory(tmp_path, "a", 0), StreamSettings(512))
    _run(plain, reference, 2)
    _run(optimizer, offloaded, 2)
    saved = optimizer.state_dict()
    assert not optimizer.inner.state  # read back for the dict, not kept
    resumed = [[t.clone() for t in group] for group in offloaded]
    again = swapped(_build(resumed), SwapDirectory(tmp_path, "b", 0), StreamSettings(700, pipeline_read=True))
    again.load_state_dict(saved)
    assert not again.inner.state and len(os.listdir(again.directory.path)) > 1
    _run(plain, reference, 2)
    _run(again, resumed, 2)
    for mine, theirs in zip(sum(resumed, []), sum(reference, [])):
        assert torch.equal(mine, theirs)
    optimizer.close()
    again.close()


def test_sub_groups_cut_tensors_on_the_alignment():
    planned = plan_subgroups([[1000, 3000], [10]], 1024)
    assert sum(sg.numel for sg in planned) == 4010
    for sub_group in planned:
        assert sub_group.numel <= 1024
        for piece in sub_group.pieces:
            assert piece.start % ALIGN == 0
    assert len(plan_subgroups([[1000, 3000]], 0)) == 1


def test_truncated_or_missing_swap_file_is_named(tmp_path):
    tensors = _tensors(3)
    directory = SwapDirectory(tmp_path, "run", 0)
    optimizer = swapped(_build(tensors), directory, StreamSettings(2048, pipeline_read=True))
    _run(optimizer, tensors, 1)
    victim = directory.file(1)
    with open(victim, "r+b") as file:
        file.truncate(100)
    with pytest.raises(SwapFileError, match=r"subgroup00001.swp.* holds 100 bytes, expected .*truncated"):
        _run(optimizer, tensors, 1)
    os.remove(victim)
    with pytest.raises(SwapFileError, match=r"subgroup00001.swp.* is missing"):
        _run(optimizer, tensors, 1)
    optimizer.close()


def test_bad_nvme_path_and_full_disk_are_named(tmp_path):
    missing = check_swap_root(tmp_path / "nope", 10)
    assert "does not exist" in missing and isinstance(problem_error(missing), SwapPathError)
    (tmp_path / "file").write_text("x")
    assert "not a directory" in check_swap_root(tmp_path / "file", 10)
    full = check_swap_root(tmp_path, 1 << 62)
    assert "MiB free but the swap files need" in full and isinstance(problem_error(full), SwapSpaceError)
    if os.geteuid() != 0:  # root writes anywhere
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
        assert "not writable" in check_swap_root(read_only, 10)


def test_full_disk_while_writing_is_named(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    directory = SwapDirectory(tmp_path, "run", 0)
    directory.file = lambda index: "/dev/full"  # every write lands on a device that is always full
    with pytest.raises(SwapSpaceError, match="is full: writing '/dev/full'"):
        directory.write(0, torch.zeros(10))


def test_tensors_without_gradients_at_the_first_step_are_stepped_later_as_in_memory(tmp_path):
    # The first sub-groups (the first tensor's) get no gradient at the first step: their files must
    # still be written whole once the state kinds are known, or the next step's read finds them short.
    reference, offloaded = _tensors(0), _tensors(0)
    plain = _build(reference)
    directory = SwapDirectory(tmp_path, "run", 0)
    optimizer = swapped(_build(offloaded), directory, StreamSettings(1000, buffer_count=2, pipeline_read=True))
    for opt, tensors in ((plain, reference), (optimizer, offloaded)):
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            for group in tensors:
                for tensor in group:
                    tensor.grad = torch.randn(tensor.numel(), generator=generator)
            if step == 0:
                tensors[0][0].grad = None
            opt.step()
    for mine, theirs in zip(sum(offloaded, []), sum(reference, [])):
        assert torch.equal(mine, theirs)
        for key, value in plain.state[theirs].items():
            assert torch.equal(optimizer.state[mine][key], value), key
    optimizer.close()
