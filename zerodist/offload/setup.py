"""From the config to a swapped optimizer: the settings, the checks every rank agrees on, the run's directory.

    offload_optimizer.device   none  the optimizer as built
                               cpu   parameters on an accelerator: `HostOffloadedOptimizer` over it (the
                                     state and the step on the host, zerodist/offload/host.py);
                                     parameters on the CPU: the optimizer as built, and one info line
                                     (the state lives on the host already)
                               nvme  `SwappedOptimizer` over it, its files under
                                     <nvme_path>/<run>/rank<r>/, <run> chosen by rank 0
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import shutil
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.config import Config
from zerodist.accelerator import get_accelerator
from zerodist.offload import errors
from zerodist.offload.host import host_offloaded
from zerodist.offload.optimizer import StreamSettings, SwappedOptimizer, swapped
from zerodist.offload.swap_files import SwapDirectory, check_swap_root, problem_error
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

# Bytes of swap file per stepped element the start-up check asks for: Adam's two fp32 states and the
# fp32 stepped values (the master, or stage 3's parameter shard, when they are swapped too); an
# optimizer with more state finds out at its first write, with the same named error.
_CHECKED_BYTES_PER_ELEMENT = 12
_RUNS = itertools.count()
# The swap directories not yet closed, reported at exit by one handler (not one per engine).
_OPEN: weakref.WeakSet[SwapDirectory] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class OffloadSettings:
    """`zero_optimization.offload_optimizer`, `offload_param` and `sub_group_size`, sliced from the config."""

    optimizer_device: str = "none"
    param_device: str = "none"
    nvme_path: str | None = None
    stream: StreamSettings = StreamSettings(sub_group_size=1_000_000_000)

    @classmethod
    def from_config(cls, config: Config) -> OffloadSettings:
        zero = config.zero_optimization
        optimizer, param = zero.offload_optimizer, zero.offload_param
        if optimizer is None:
            stream = StreamSettings(sub_group_size=zero.sub_group_size)
            return cls(param_device=param.device if param is not None else "none", stream=stream)
        return cls(optimizer.device, param.device if param is not None else "none", optimizer.nvme_path,
                   StreamSettings(zero.sub_group_size, optimizer.buffer_count, optimizer.pipeline_read,
                                  optimizer.pipeline_write))

    @property
    def swaps(self) -> bool:
        return self.optimizer_device == "nvme"


def offloaded_build(build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], settings: OffloadSettings,
                    group: Group, device: torch.device) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """`build` (the engine's optimizer factory over the flat shards), offloaded as `settings` say."""
    if settings.optimizer_device == "none" and settings.param_device == "none":
        return build
    if not get_accelerator().is_host(device):
        return _from_accelerator(build, settings, device)
    cpu = [f"{key}.device=\"cpu\"" for key, value in (("offload_optimizer", settings.optimizer_device),
                                                      ("offload_param", settings.param_device)) if value == "cpu"]
    if cpu:
        log_rank0(logger, "offload: %s %s nothing here: the parameters are on the CPU, so their state lives on "
                  "the host already", " and ".join(cpu), "changes" if len(cpu) == 1 else "change")
    if not settings.swaps:
        return build

    def build_swapped(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        inner = build(groups)
        numel = sum(t.numel() for g in groups for t in g["params"])
        directory = open_swap_directory(settings.nvme_path or "", numel * _CHECKED_BYTES_PER_ELEMENT, group)
        return swapped(inner, directory, settings.stream, group)

    return build_swapped


def _from_accelerator(build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], settings: OffloadSettings,
                      device: torch.device) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """Parameters on an accelerator: `offload_optimizer: cpu` steps on the host; the rest is refused."""
    if settings.optimizer_device != "cpu" or settings.param_device != "none":
        raise errors.OffloadError(
            f"offload_optimizer.device={settings.optimizer_device!r}, offload_param.device="
            f"{settings.param_device!r} with parameters on {device.type}: from an accelerator zerodist offloads "
            "the optimizer to the host only; set offload_optimizer.device to \"cpu\" and offload_param.device "
            "to \"none\"")

    def build_on_host(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return host_offloaded(build(groups), device)

    log_rank0(logger, "offload: the optimizer state and step on the host, the parameters on %s", device)
    return build_on_host


def open_swap_directory(root: str, needed_bytes: int, group: Group) -> SwapDirectory:
    """This rank's swap directory under `root`, after every rank checked its own (a problem on any
    rank is the same named error on every rank)."""
    # Time, process and a count: two engines of one process (one resuming while the other ends) never share one.
    candidate = f"zerodist-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_RUNS)}"
    answers: list[Any] = [None] * comm.get_world_size(group)
    problem = check_swap_root(root, needed_bytes)
    comm.all_gather_object(answers, (candidate, problem, None if problem else disk_of(root), needed_bytes),
                           group=group)
    failed = [(rank, problem) for rank, (_, problem, _, _) in enumerate(answers) if problem is not None]
    failed = failed or shared_disk_problems(root, [(disk, needed) for _, _, disk, needed in answers])
    if failed:
        rank, problem = failed[0]
        raise problem_error(problem if len(failed) == len(answers) else f"on rank {rank}: {problem}")
    directory = SwapDirectory(root, answers[0][0], comm.get_rank())
    log_rank0(logger, "offload: optimizer state in swap files under %s (removed by destroy(); a process that "
              "dies leaves them there)", directory.path.parent)
    if not _OPEN:
        atexit.unregister(_report_left)  # registered once at a time, however many engines
        atexit.register(_report_left)
    _OPEN.add(directory)
    return directory


def disk_of(root: str) -> tuple[str, int, int]:
    """(host, device, free bytes) of the file system under `root`: ranks with the same host and device
    share its free space."""
    return os.uname().nodename, os.stat(root).st_dev, shutil.disk_usage(root).free


def shared_disk_problems(root: str, disks: list[tuple[tuple[str, int, int] | None, int]]) -> list[tuple[int, str]]:
    """(rank, problem) for each rank whose disk the ranks sharing it overfill together (each rank's own
    check passes when each alone fits: two ranks on one disk then failed at their first step)."""
    sharing: dict[tuple[str, int], list[int]] = {}
    free_of: dict[tuple[str, int], int] = {}
    for rank, (disk, _) in enumerate(disks):
        if disk is not None:
            sharing.setdefault(disk[:2], []).append(rank)
            free_of[disk[:2]] = min(free_of.get(disk[:2], disk[2]), disk[2])
    problems = []
    for key, ranks in sharing.items():
        free, needed = free_of[key], sum(disks[r][1] for r in ranks)
        if len(ranks) > 1 and needed > free:
            problems += [(r, f"nvme_path {root!r} has {free / 2**20:.1f} MiB free but the swap files need "
                             f"{needed / 2**20:.1f} MiB on its disk: ranks {ranks} share it, "
                             f"{disks[ranks[0]][1] / 2**20:.1f} MiB each; free space or give the ranks "
                             "directories on other disks") for r in ranks]
    return problems


def _report_left() -> None:
    for directory in list(_OPEN):
        if not directory.closed and directory.path.exists():
            logger.warning("offload: swap files left under %s (the engine was not destroyed); remove them when done",
                           directory.path)


def close_offload(optimizer: Any) -> None:
    """Remove an offloaded optimizer's swap files (nothing for any other optimizer)."""
    if isinstance(optimizer, SwappedOptimizer):
        optimizer.close()
