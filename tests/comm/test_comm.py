"""The communication layer: init paths, every collective against a reference, the tracer."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch

import zerodist.comm as comm
from zerodist.comm.init import read_launch_env, resolve_timeout
from tests.harness import DistributedTestFailure, distributed_test, run_distributed, start_pool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL_TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
            "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


# ---------------------------------------------------------------- launch environment (pure)

@pytest.mark.unit
def test_launch_env_torchrun_complete():
    launch = read_launch_env(FULL_TORCHRUN)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_port) == (1, 2, 1, 29500)
    assert launch.source == "torchrun"


@pytest.mark.unit
def test_launch_env_empty_is_one_process_world():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size) == (0, 1)
    assert "one-process" in launch.source


@pytest.mark.unit
@pytest.mark.parametrize(
    "env, fragments",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["missing MASTER_ADDR, MASTER_PORT", "RANK=0", "zerodist run"]),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, ["missing RANK, WORLD_SIZE"]),
        ({"LOCAL_RANK": "0"}, ["missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT", "LOCAL_RANK=0"]),
        ({**FULL_TORCHRUN, "RANK": "2"}, ["rank 2 is outside [0, world size 2)"]),
        ({**FULL_TORCHRUN, "WORLD_SIZE": "two"}, ["WORLD_SIZE='two' is not an integer"]),
        ({**FULL_TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT 70000"]),
        ({**FULL_TORCHRUN, "LOCAL_WORLD_SIZE": "1"}, ["LOCAL_WORLD_SIZE 1"]),
        ({**FULL_TORCHRUN, "LOCAL_RANK": "3", "RANK": "1"}, ["local rank 3"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, ["missing SLURM_LOCALID"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, ["needs MASTER_ADDR"]),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, ["missing OMPI_COMM_WORLD_LOCAL_RANK"]),
    ],
)
def test_launch_env_rejects_partial_or_inconsistent(env, fragments):
    with pytest.raises(comm.DistributedInitError) as info:
        read_launch_env(env)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.unit
def test_launch_env_slurm_and_openmpi():
    slurm = read_launch_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "n0"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_port, slurm.source) == (3, 4, 1, 29500, "SLURM")
    ompi = read_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert (ompi.rank, ompi.world_size, ompi.master_port, ompi.source) == (1, 2, 1234, "Open MPI")


@pytest.mark.unit
def test_init_with_partial_env_fails_within_a_second(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def joined(*args, **kwargs):
        raise AssertionError("init_distributed began a rendezvous")

    # Not the 300 s join: no wait at all, shown by the rendezvous never being begun (not by a clock).
    monkeypatch.setattr("zerodist.comm.init.join_store", joined)
    monkeypatch.setattr("torch.distributed.init_process_group", joined)
    with pytest.raises(comm.DistributedInitError, match="missing MASTER_ADDR, MASTER_PORT"):
        comm.init_distributed()
    assert not comm.is_initialized()


@pytest.mark.unit
def test_timeout_resolution(monkeypatch):
    monkeypatch.delenv("ZERODIST_TIMEOUT", raising=False)
    assert resolve_timeout(None) is None
    assert resolve_timeout(5) == datetime.timedelta(seconds=5)
    monkeypatch.setenv("ZERODIST_TIMEOUT", "7.5")
    assert resolve_timeout(None) == datetime.timedelta(seconds=7.5)
    assert resolve_timeout(3) == datetime.timedelta(seconds=3)  # the argument wins
    monkeypatch.setenv("ZERODIST_TIMEOUT", "soon")
    with pytest.raises(comm.DistributedInitError, match="ZERODIST_TIMEOUT"):
        resolve_timeout(None)
    with pytest.raises(comm.DistributedInitError, match="> 0"):
        resolve_timeout(-1)


# ---------------------------------------------------------------- init in real processes

@pytest.mark.multiprocess
def test_collective_without_init_in_one_process_world():
    code = "import torch, zerodist.comm as c; t = torch.ones(3); c.all_reduce(t); print(t.tolist(), c.init_distributed().source)"
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[1.0, 1.0, 1.0] one-process world" in out.stdout


@pytest.mark.multiprocess
def test_adopts_a_user_made_process_group():
    code = (
        "import torch.distributed as d, zerodist.comm as c\n"
        "d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1)\n"
        "info = c.init_distributed(); assert c.init_distributed() is info\n"
        "import torch; t = torch.full((2,), 3.0); c.all_reduce(t)\n"
        "print(info.source, info.backend, t.tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "adopted" in out.stdout and "gloo [3.0, 3.0]" in out.stdout


@pytest.mark.multiprocess
def test_partial_env_in_a_fresh_process_names_missing_variables():
    code = "import torch, zerodist.comm as c; c.all_reduce(torch.ones(1))"
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(RANK="0", WORLD_SIZE="2"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "DistributedInitError" in out.stderr and "missing MASTER_ADDR, MASTER_PORT" in out.stderr


@distributed_test(world_size=[1, 2])
def test_workers_initialised_from_torchrun_variables(world_size):
    info = comm.init_distributed()
    assert info.source in ("torchrun", "torchrun variables (world size 1)")
    assert info.world_size == world_size == comm.get_world_size()
    assert info.rank == comm.get_rank() == comm.get_local_rank() == int(os.environ["RANK"])
    assert info.backend == "gloo"
    assert comm.init_distributed() is info  # idempotent


# ---------------------------------------------------------------- collectives vs reference

def _rank_tensor(rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


@pytest.mark.parametrize("async_op", [False, True])
@distributed_test(world_size=[1, 2, 4])
def test_every_collective_matches_reference(world_size, async_op):
    rank, n = comm.get_rank(), world_size
    numel = 6 * n
    everyone = [_rank_tensor(r, numel) for r in range(n)]
    total = torch.stack(everyone).sum(0)

    t = _rank_tensor(rank, numel)
    comm.all_reduce(t, async_op=async_op).wait()
    torch.testing.assert_close(t, total)

    t = _rank_tensor(rank, numel)
    comm.all_reduce(t, op=comm.ReduceOp.AVG, async_op=async_op).wait()
    torch.testing.assert_close(t, total / n)

    t = _rank_tensor(rank, numel)
    comm.all_reduce(t, op=comm.ReduceOp.MAX, async_op=async_op).wait()
    torch.testing.assert_close(t, torch.stack(everyone).max(0).values)

    out = torch.empty(numel // n)
    handle = comm.reduce_scatter(out, _rank_tensor(rank, numel), async_op=async_op)
    assert handle.wait() is out
    torch.testing.assert_close(out, total.chunk(n)[rank])

    out = torch.empty(numel // n)
    comm.reduce_scatter(out, _rank_tensor(rank, numel), op=comm.ReduceOp.AVG, async_op=async_op).wait()
    torch.testing.assert_close(out, (total / n).chunk(n)[rank])

    gathered = torch.empty(numel * n)
    comm.all_gather(gathered, _rank_tensor(rank, numel), async_op=async_op).wait()
    torch.testing.assert_close(gathered, torch.cat(everyone))

    # all_to_all: rank r sends chunk j of its tensor to rank j.
    out = torch.empty(numel)
    comm.all_to_all_single(out, _rank_tensor(rank, numel), async_op=async_op).wait()
    torch.testing.assert_close(out, torch.cat([everyone[r].chunk(n)[rank] for r in range(n)]))

    t = _rank_tensor(rank, numel)
    comm.broadcast(t, src=n - 1, async_op=async_op).wait()
    torch.testing.assert_close(t, everyone[n - 1])

    t = _rank_tensor(rank, numel)
    comm.reduce(t, dst=0, async_op=async_op).wait()
    if rank == 0:
        torch.testing.assert_close(t, total)

    comm.barrier(async_op=async_op).wait()

    objs = [None] * n
    comm.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(n)]
    box = [f"from {rank}"]
    comm.broadcast_object_list(box, src=0)
    assert box == ["from 0"]


@pytest.mark.parametrize("async_op", [False, True])
@distributed_test(world_size=[2, 4])
def test_all_gather_paths_give_torchs_bits(world_size, async_op):
    """[Note: gloo all-gather]: gloo gathers by one in-place broadcast per rank when `input` is this
    rank's slot of `output` or lies outside it; other layouts take torch's all-gather. Both give
    exactly what torch's own all-gather gives, over the world and over a subgroup."""
    import torch.distributed as dist

    from zerodist.comm.collectives import _gathers_by_broadcast

    rank, n, numel = comm.get_rank(), world_size, 37

    def bits(t: torch.Tensor) -> torch.Tensor:  # compares -0.0 and 0.0 as different
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    odd = comm.new_group([r for r in range(n) if r % 2])  # every rank creates it; only odd ones use it
    for dtype in (torch.float32, torch.bfloat16):
        mine = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
        mine[0] = -0.0
        expected = torch.empty(numel * n, dtype=dtype)
        dist.all_gather_into_tensor(expected, mine)

        out = torch.full((numel * n,), float("nan"), dtype=dtype)  # input outside output
        assert _gathers_by_broadcast(out, mine, None)
        comm.all_gather(out, mine, async_op=async_op).wait()
        assert torch.equal(bits(out), bits(expected))

        out = torch.full((numel * n,), float("nan"), dtype=dtype)  # in place: input is this rank's slot
        out[rank * numel:(rank + 1) * numel] = mine
        slot = out[rank * numel:(rank + 1) * numel]
        assert _gathers_by_broadcast(out, slot, None)
        comm.all_gather(out, slot, async_op=async_op).wait()
        assert torch.equal(bits(out), bits(expected))

        buffer = torch.zeros(numel * n + 1, dtype=dtype)  # input overlaps output elsewhere: torch's path
        buffer[:numel] = mine
        out, source = buffer[1:], buffer[:numel]
        assert not _gathers_by_broadcast(out, source, None)

        if rank % 2:
            members = comm.get_world_size(odd)
            sub_expected = torch.empty(numel * members, dtype=dtype)
            dist.all_gather_into_tensor(sub_expected, mine, group=odd)
            out = torch.empty(numel * members, dtype=dtype)
            comm.all_gather(out, mine, group=odd, async_op=async_op).wait()
            assert torch.equal(bits(out), bits(sub_expected))


@distributed_test(world_size=2)
def test_bf16_and_uneven_all_to_all():
    rank = comm.get_rank()
    t = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
    comm.all_reduce(t)
    assert t.dtype == torch.bfloat16 and t.tolist() == [3.0] * 5
    # rank 0 sends 1 element to rank 0 and 2 to rank 1; rank 1 sends 3 to rank 0 and 1 to rank 1
    sends = [[1, 2], [3, 1]]
    inp = torch.arange(sum(sends[rank]), dtype=torch.float32) + 10 * rank
    out = torch.empty(sends[0][rank] + sends[1][rank])
    comm.all_to_all_single(out, inp, output_split_sizes=[sends[0][rank], sends[1][rank]], input_split_sizes=sends[rank])
    expected = {0: [0.0, 10.0, 11.0, 12.0], 1: [1.0, 2.0, 13.0]}[rank]
    assert out.tolist() == expected


@distributed_test(world_size=2)
def test_size_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"all_gather: output has 5 elements but must have group size \(2\) x input \(3\) = 6"):
        comm.all_gather(torch.empty(5), torch.empty(3))
    with pytest.raises(ValueError, match="reduce_scatter: input has 7 elements"):
        comm.reduce_scatter(torch.empty(3), torch.empty(7))


# ---------------------------------------------------------------- tracer

@distributed_test(world_size=[1, 2, 4])
def test_tracer_counts_bytes_exactly(world_size):
    n = world_size
    with comm.trace() as t:
        comm.all_reduce(torch.ones(10))
        comm.all_reduce(torch.ones(6, dtype=torch.bfloat16))
        comm.reduce_scatter(torch.empty(4), torch.ones(4 * n))
        comm.all_gather(torch.empty(8 * n, dtype=torch.float16), torch.ones(8, dtype=torch.float16))
        comm.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))
        comm.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        with comm.trace(ops=["all_gather"]) as inner:
            comm.all_gather(torch.empty(n), torch.ones(1))
    summary = t.summary()
    assert list(summary) == ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]
    assert summary["all_reduce"].count == 2
    assert summary["all_reduce"].num_bytes == 10 * 4 + 6 * 2
    assert summary["reduce_scatter"].num_bytes == 4 * n * 4  # the unreduced input
    assert summary["all_gather"].num_bytes == 8 * n * 2 + n * 4  # the gathered output
    assert summary["all_to_all"].num_bytes == 2 * n * 4
    assert summary["broadcast"].num_bytes == 24
    assert summary["all_reduce"].time_s is None  # not timed unless asked
    factor = (n - 1) / n
    assert t.bus_elements("all_reduce") == pytest.approx(16 * 2 * factor)
    assert t.bus_elements("reduce_scatter") == pytest.approx(4 * n * factor)
    assert summary["broadcast"].bus_bytes == 24
    assert inner.count() == 1 and inner.total_numel() == n
    assert comm.tracer.active_traces == []


@distributed_test(world_size=2)
def test_tracer_timing_gives_bandwidth():
    with comm.trace(timing=True) as t:
        for _ in range(3):
            comm.all_reduce(torch.ones(1 << 16), async_op=True).wait()
    s = t.summary()["all_reduce"]
    assert s.count == 3 and s.time_s > 0
    assert s.busbw_gbps == pytest.approx(s.algbw_gbps * 2 * (2 - 1) / 2)
    assert "all_reduce" in t.format_summary()


@distributed_test(world_size=2)
def test_blocked_meter_counts_synchronous_collectives_and_waits():
    """Rank 1 arrives late to each collective, so rank 0 must block: inside the synchronous call,
    then inside wait() (a second wait blocks no more). Nested meters both count; none is left on."""
    late, rank = 1.0, comm.get_rank()
    comm.barrier()
    with comm.measure_blocked() as outer:
        with comm.measure_blocked() as sync_meter:
            if rank == 1:
                time.sleep(late)
            comm.all_reduce(torch.ones(4))
        with comm.measure_blocked() as wait_meter:
            if rank == 1:
                time.sleep(late)
            handle = comm.all_reduce(torch.ones(4), async_op=True)
            handle.wait()
            handle.wait()
    assert comm.tracer.blocked_meters == []
    assert sync_meter.num_blocking_calls == 1 and wait_meter.num_blocking_calls == 1
    assert outer.num_blocking_calls == 2 and outer.seconds == pytest.approx(sync_meter.seconds + wait_meter.seconds)
    if rank == 0:  # lower bounds only: rank 0 waited for rank 1's sleep, less any delay of its own (up to
        # 0.75 s of it here: 0.25 s of 0.5 s was a margin a loaded machine's wake-ups could eat)
        assert sync_meter.seconds > late / 4 and wait_meter.seconds > late / 4
    with comm.trace(timing=True), comm.measure_blocked() as timed:
        comm.all_reduce(torch.ones(4), async_op=True).wait()  # a timed trace blocks where it issues
    assert timed.num_blocking_calls == 1


@pytest.mark.unit
def test_bus_factors_follow_nccl_tests():
    assert comm.bus_factor("all_reduce", 4) == 1.5
    assert comm.bus_factor("reduce_scatter", 4) == comm.bus_factor("all_gather", 4) == 0.75
    assert comm.bus_factor("all_to_all", 8) == 7 / 8
    assert comm.bus_factor("broadcast", 8) == comm.bus_factor("reduce", 8) == 1.0
    assert comm.bus_factor("barrier", 8) == 0.0


# ---------------------------------------------------------------- the harness itself

def _fail_on_rank_one_while_rank_zero_waits():
    if comm.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    comm.barrier()  # rank 0 would wait here forever for rank 1


@pytest.mark.multiprocess
def test_harness_fails_all_ranks_fast_when_one_rank_fails():
    start_pool(2)  # the bound below times the failure, not a fresh pool's start-up
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_fail_on_rank_one_while_rank_zero_waits, 2, timeout=240)
    message = str(info.value)
    assert "rank 1" in message and "injected failure on rank 1" in message
    assert "did not finish" in message and "[0]" in message
    # the 3 s grace after the failure, not the 240 s deadline: a margin of minutes, far above a loaded
    # machine's noise (a bound of 30 s against a 60 s deadline was not)
    assert time.monotonic() - start < 120


def _return_rank_and_sum(offset):
    t = torch.tensor([float(comm.get_rank() + offset)])
    comm.all_reduce(t)
    return comm.get_rank(), t.item()


@pytest.mark.multiprocess
def test_harness_returns_each_ranks_value():
    assert run_distributed(_return_rank_and_sum, 2, 1) == [(0, 3.0), (1, 3.0)]


@pytest.mark.parametrize("async_op", [False, True])
@distributed_test(world_size=[2, 4])
def test_reduce_scatter_of_a_scratch_input_is_the_same_reduce_scatter(async_op):
    """[Note: gloo reduce-scatter]: a scratch input is all-reduced in place on gloo; the result is
    bitwise the plain reduce-scatter's, into a separate output or into the input's own slice, with
    AVG too, and the tracer still sees one reduce-scatter of the input's size."""
    from zerodist.comm import collectives

    rank, n = comm.get_rank(), comm.get_world_size()
    values = torch.randn(n * 192, generator=torch.Generator().manual_seed(rank))
    for op in (comm.ReduceOp.SUM, comm.ReduceOp.AVG):
        expected = torch.empty(192)
        collectives.reduce_scatter(expected, values.clone(), op=op)
        out = torch.empty(192)
        with comm.trace() as t:
            handle = collectives.reduce_scatter(out, values.clone(), op=op, async_op=async_op, input_is_scratch=True)
            assert handle.wait() is out
        assert torch.equal(out, expected)
        assert t.summary()["reduce_scatter"].count == 1 and t.summary()["reduce_scatter"].num_bytes == n * 192 * 4
        scratch = values.clone()
        own = scratch[rank * 192: (rank + 1) * 192]  # the output is the input's own slice (ZeRO-1's buffer)
        collectives.reduce_scatter(own, scratch, op=op, async_op=async_op, input_is_scratch=True).wait()
        assert torch.equal(own, expected)
