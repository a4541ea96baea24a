"""Process-group initialisation: the one path every collective goes through.

`init_distributed()` reads the launcher's variables (torchrun, SLURM or Open MPI), validates
them *before* any rendezvous, and either adopts the process group the user already made,
creates one, or, with no launcher variables at all, makes a one-process world so that a
script runs unchanged on a laptop. Collectives call `ensure_initialized()`, so none of them
can meet an uninitialised backend (the `'NoneType' object has no attribute 'all_reduce'`
that DeepSpeed users get when `init_distributed()` was forgotten).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import sys
from collections.abc import Mapping

import torch
import torch.distributed as dist

from zerodist.comm.errors import DistributedInitError
from zerodist.comm.join import join_store, join_timeout_s
from zerodist.comm.watchdog import DEFAULT_COLLECTIVE_TIMEOUT_S, watchdog
from zerodist.utils import get_logger, parse_int_env

logger = get_logger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_OPENMPI_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
_HOW_TO_LAUNCH = (
    "Launch with `zerodist run --nproc N script.py` or `torchrun --nproc-per-node N script.py`, "
    "which set all of them, or unset them all to run as a one-process world."
)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process, validated. `source` names the launcher."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """How this process joined the world. Kept only for reporting; groups live in torch."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    source: str
    timeout_s: float | None


_world: WorldInfo | None = None


def _missing_error(source: str, found: Mapping[str, str], missing: list[str]) -> DistributedInitError:
    seen = ", ".join(f"{k}={v}" for k, v in found.items()) or "none"
    return DistributedInitError(
        f"incomplete {source} launch environment: found {seen}; missing {', '.join(missing)}. "
        + _HOW_TO_LAUNCH
    )


def _ints(environ: Mapping[str, str], names: tuple[str, ...]) -> list[int]:
    try:
        return [parse_int_env(dict(environ), name) for name in names]  # type: ignore[misc]
    except ValueError as err:
        raise DistributedInitError(f"bad launch environment: {err}. {_HOW_TO_LAUNCH}") from None


def read_launch_env(environ: Mapping[str, str] | None = None, *, need_master: bool = True) -> LaunchEnv:
    """Parse and validate the launcher's variables; never touches the network.

    `need_master=False` when the caller passes its own `init_method` (then MASTER_ADDR and
    MASTER_PORT are not used).
    """
    env = os.environ if environ is None else environ
    torchrun = {k: env[k] for k in _TORCHRUN_VARS if k in env}
    # MASTER_ADDR/PORT are shared with SLURM and Open MPI launches; RANK etc. are torchrun's own.
    if torchrun.keys() & {"RANK", "WORLD_SIZE", "LOCAL_RANK"}:
        return _from_torchrun(env, torchrun, need_master)
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        rank, world, local = _from_scheme(env, _SLURM_VARS, "SLURM")
        return _with_master(env, rank, world, local, "SLURM", need_master)
    if "OMPI_COMM_WORLD_SIZE" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        rank, world, local = _from_scheme(env, _OPENMPI_VARS, "Open MPI")
        return _with_master(env, rank, world, local, "Open MPI", need_master)
    if torchrun:
        return _from_torchrun(env, torchrun, need_master)
    return LaunchEnv(0, 1, 0, None, None, "one-process world (no launcher variables)")


def _from_torchrun(env: Mapping[str, str], found: dict[str, str], need_master: bool) -> LaunchEnv:
    required = ["RANK", "WORLD_SIZE"] + (["MASTER_ADDR", "MASTER_PORT"] if need_master else [])
    missing = [k for k in required if k not in env]
    rank, world, local = _ints(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    # RANK=0 WORLD_SIZE=1 with no rendezvous address is a complete one-process description.
    if world == 1 and rank in (0, None) and set(missing) <= {"MASTER_ADDR", "MASTER_PORT"}:
        return LaunchEnv(0, 1, local or 0, None, None, "torchrun variables (world size 1)")
    if missing:
        raise _missing_error("torchrun", found, missing)
    return _validated(env, rank, world, local if local is not None else rank, "torchrun", need_master)


def _from_scheme(env: Mapping[str, str], names: tuple[str, ...], source: str) -> tuple[int, int, int]:
    missing = [k for k in names if k not in env]
    if missing:
        raise _missing_error(source, {k: env[k] for k in names if k in env}, missing)
    rank, world, local = _ints(env, names)
    return rank, world, local  # type: ignore[return-value]


def _with_master(env, rank, world, local, source, need_master) -> LaunchEnv:
    if need_master and "MASTER_ADDR" not in env:
        raise DistributedInitError(
            f"{source} launch (rank {rank} of {world}) needs MASTER_ADDR (the first node's "
            "address) and optionally MASTER_PORT (default 29500); export them in the job script. "
            + _HOW_TO_LAUNCH
        )
    return _validated(env, rank, world, local, source, need_master, default_port=29500)


def _validated(env, rank, world, local, source, need_master, default_port=None) -> LaunchEnv:
    problems = []
    if world < 1:
        problems.append(f"world size {world} < 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"rank {rank} is outside [0, world size {world})")
    if local < 0 or local > rank:
        problems.append(f"local rank {local} must be in [0, rank {rank}]")
    (local_world,) = _ints(env, ("LOCAL_WORLD_SIZE",))
    if local_world is not None and not 0 <= local < local_world:
        problems.append(f"local rank {local} is outside [0, LOCAL_WORLD_SIZE {local_world})")
    port = None
    if need_master:
        (port,) = _ints(env, ("MASTER_PORT",))
        port = default_port if port is None else port
        if port is not None and not 0 < port < 65536:
            problems.append(f"MASTER_PORT {port} is not a TCP port (1-65535)")
    if problems:
        raise DistributedInitError(
            f"inconsistent {source} launch environment: {'; '.join(problems)}. " + _HOW_TO_LAUNCH
        )
    return LaunchEnv(rank, world, local, env.get("MASTER_ADDR"), port, source)


def available_backends() -> dict[str, bool]:
    """Which process-group backends this torch build offers."""
    return {name: dist.is_backend_available(name) for name in ("gloo", "nccl", "mpi")}


def resolve_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """The configured collective timeout: the argument, else `ZERODIST_TIMEOUT` seconds, else None
    (then collectives wait `DEFAULT_COLLECTIVE_TIMEOUT_S` and joining `DEFAULT_JOIN_TIMEOUT_S`)."""
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout is None:
        raw = os.environ.get("ZERODIST_TIMEOUT")
        if not raw:
            return None
        try:
            timeout = float(raw)
        except ValueError:
            raise DistributedInitError(f"ZERODIST_TIMEOUT={raw!r} is not a number of seconds") from None
    if timeout <= 0:
        raise DistributedInitError(f"collective timeout must be > 0 seconds, got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


_warned_cpu_fallback: set[tuple[int, int]] = set()


def choose_backend(local_rank: int, backend: str | None) -> str:
    """NCCL when every rank on this node has its own GPU, gloo otherwise; an explicit choice is checked.

    [Note: one backend per world] The choice is made for the node, not the rank: with more local
    ranks (LOCAL_WORLD_SIZE) than GPUs, a choice per rank would put the first ranks on NCCL and the
    rest on gloo, and the world would never form. All of them take gloo on the CPU then, with a
    warning that says how to get NCCL."""
    if backend is None:
        backend = os.environ.get("ZERODIST_BACKEND") or None
    if backend is None:
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            return "gloo"
        local_world = max(local_rank + 1, parse_int_env(dict(os.environ), "LOCAL_WORLD_SIZE") or 1)
        gpus = torch.cuda.device_count()
        if gpus >= local_world:
            return "nccl"
        if (local_world, gpus) not in _warned_cpu_fallback:
            _warned_cpu_fallback.add((local_world, gpus))
            logger.warning("%d rank(s) on this node but %d GPU(s): every rank trains on the CPU over gloo. For NCCL, "
                           "start one rank per GPU (torchrun --nproc-per-node %d), or set ZERODIST_BACKEND=gloo to "
                           "choose the CPU and silence this", local_world, gpus, gpus)
        return "gloo"
    if not dist.is_backend_available(backend):
        raise DistributedInitError(f"backend {backend!r} is not available in this torch build")
    if backend == "nccl" and torch.cuda.device_count() <= local_rank:
        raise DistributedInitError(
            f"backend 'nccl' needs a GPU per rank, but local rank {local_rank} sees "
            f"{torch.cuda.device_count()} GPU(s); use backend='gloo' or fewer ranks per node"
        )
    return backend


def init_distributed(
    backend: str | None = None,
    *,
    timeout: float | datetime.timedelta | None = None,
    init_method: str | None = None,
) -> WorldInfo:
    """Join (or adopt, or create) the default process group. Idempotent.

    Returns how this process joined. Raises `DistributedInitError` at once, before any
    rendezvous, when the launcher's variables are partial or inconsistent, and after the join
    timeout when a rank never comes (zerodist/comm/join.py: the configured `timeout`, else
    5 minutes), having logged who waits for whom from the fifth second on.
    """
    global _world
    if dist.is_initialized():
        if _world is None:
            _world = _adopt()
            _destroy_at_exit()
        return _world
    _world = None  # the user destroyed the group we recorded
    launch = read_launch_env(need_master=init_method is None)
    chosen = choose_backend(launch.local_rank, backend)
    delta = resolve_timeout(timeout)
    # Unset, the collectives' timeout is ours, not torch's 30 minutes ([Note: watchdog cost]).
    collective_timeout = delta or datetime.timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    if chosen == "nccl":
        torch.cuda.set_device(launch.local_rank)
    if launch.world_size == 1 and launch.master_addr is None and init_method is None:
        # No rendezvous needed: an in-memory store, so no port is ever opened.
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=collective_timeout)
    elif init_method is None:
        # The launcher's store, joined by zerodist itself so that a rank that never comes is
        # reported while the others wait, and fails them within the join timeout.
        assert launch.master_addr is not None and launch.master_port is not None  # need_master=True read both
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        store = join_store(launch.rank, launch.world_size, launch.master_addr, launch.master_port,
                           join_timeout_s(delta))
        store.set_timeout(collective_timeout)
        # As torch's own rendezvous does: the group's keys under a prefix of their own.
        dist.init_process_group(chosen, store=dist.PrefixStore("default_pg", store), rank=launch.rank,
                                world_size=launch.world_size, timeout=collective_timeout)
    else:
        dist.init_process_group(chosen, init_method=init_method, rank=launch.rank,
                                world_size=launch.world_size, timeout=collective_timeout)
    _world = WorldInfo(
        launch.rank, launch.world_size, launch.local_rank, chosen, launch.source, collective_timeout.total_seconds(),
    )
    watchdog.reset()
    logger.debug("joined world: %s", _world)
    _destroy_at_exit()
    return _world


_EXIT_HANDLER_REGISTERED = False


def _destroy_at_exit() -> None:
    """Destroy the default group while the interpreter is still whole. A process that exits
    with a gloo group alive can abort in finalization ("terminate called without an active
    exception": gloo's worker threads still hold tensors; pytorch#190489), after its work is done."""
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        _EXIT_HANDLER_REGISTERED = True
        atexit.register(destroy_world)


def destroy_world() -> None:
    """Destroy every process group now and free what still holds them. Idempotent; never raises.

    destroy_process_group() only unregisters the groups: a C++ group (with its gloo threads and
    the tensors of work still in flight) lives on while any Python object refers to it. After an
    uncaught exception the traceback kept for post-mortem debugging (sys.last_traceback) holds
    the failed frames, and with them the engine, the topology's groups and their tensors, until
    the interpreter's finalization, where releasing a tensor that gloo's work still holds needs a
    Python that is gone and aborts (pytorch#179291). So the traceback is dropped and the garbage
    collected here, while the interpreter is whole."""
    try:
        if dist.is_initialized():
            watchdog.publish_exit()  # a rank still waiting for this one is told it left, not just "connection closed"
            dist.destroy_process_group()
            watchdog.linger_after_failure()  # [Note: the failed rank lingers] in watchdog.py
            watchdog.release_store()
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
    except Exception as error:  # exiting anyway: say so, never mask the exit
        logger.debug("destroy_process_group at exit failed: %s", error)


def _adopt() -> WorldInfo:
    env_local = os.environ.get("LOCAL_RANK")
    local = int(env_local) if env_local and env_local.isdigit() else 0
    return WorldInfo(
        dist.get_rank(), dist.get_world_size(), local, dist.get_backend(),
        "adopted a process group made with torch.distributed.init_process_group", None,
    )


def ensure_initialized() -> WorldInfo:
    """The world, initialising it through `init_distributed()` on first use."""
    if _world is not None and dist.is_initialized():
        return _world
    return init_distributed()


def is_initialized() -> bool:
    """Whether a default process group exists (never initialises)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    ensure_initialized()
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    ensure_initialized()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    return ensure_initialized().local_rank


def device_for_rank() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    info = ensure_initialized()
    return torch.device("cuda", info.local_rank) if info.backend == "nccl" else torch.device("cpu")


def get_global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group`'s member number `group_rank`."""
    ensure_initialized()
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
