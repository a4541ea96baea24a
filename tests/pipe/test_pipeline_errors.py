"""No hangs: a message other than the expected one, a stage that dies and one that is stuck are
named errors on every rank, well within the test's deadline. Each failing body raises, so the
harness tears its pool down (no stray message survives into another test)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import DistributedTestFailure, run_distributed
from zerodist.comm import p2p
from zerodist.pipe import PipelineError, PipelineModule
from tests.pipe.test_pipeline_engine import GAS, config, micro_batch, mlp_layers


def wrong_label_body() -> None:
    if comm.get_rank() == 0:
        p2p.send_message([torch.ones(4, 8)], 1, label=(1, 1, 0)).wait(10)
    else:
        p2p.recv_message(0, label=(1, 1, 1), describe="the activation of micro-batch 1", timeout_s=10)


def wrong_shape_body() -> None:
    if comm.get_rank() == 0:
        p2p.send_message([torch.ones(4, 8, dtype=torch.float64)], 1, label=(2, 0, 0)).wait(10)
    else:
        p2p.recv_message(0, label=(2, 0, 0), describe="the output gradient of micro-batch 0",
                         expect=[((4, 8), torch.float32)], timeout_s=10)


def roundtrip_body() -> list[float]:
    with comm.trace() as trace:
        if comm.get_rank() == 0:
            p2p.send_message([torch.arange(6.0).view(2, 3), torch.tensor([1, 2])], 1, label=(1, 1, 3)).wait(10)
            return [float(trace.total_bytes("send"))]
        a, b = p2p.recv_message(0, label=(1, 1, 3), describe="x", timeout_s=10)
        return [float(trace.total_bytes("recv")), a.sum().item(), float(b.dtype == torch.int64)]


def sizes_body() -> list[bool]:
    """Small messages travel inside the header's message, large ones as header then payload: both
    arrive exact, every dtype at its alignment, in the order sent."""
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(3, generator=g).to(torch.bfloat16), torch.tensor([True, False, True]),
             torch.randn(2, 2, generator=g, dtype=torch.float64), torch.randn(1, generator=g).to(torch.complex128)]
    large = [torch.randn(64, 64, generator=g), torch.arange(5)]  # 16 KiB: over p2p.INLINE_BYTES
    if comm.get_rank() == 0:
        handles = [p2p.send_message(small, 1, label=(1, 0, 0)), p2p.send_message(large, 1, label=(1, 0, 1))]
        for handle in handles:
            handle.wait(10)
        return []
    got_small = p2p.recv_message(0, label=(1, 0, 0), describe="small", timeout_s=10)
    got_large = p2p.recv_message(0, label=(1, 0, 1), describe="large", timeout_s=10)
    return [a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got_small + got_large, small + large)]


def test_small_and_large_messages_arrive_exact():
    assert run_distributed(sizes_body, 2)[1] == [True] * 6


def test_messages_carry_shapes_and_dtypes():
    sender, receiver = run_distributed(roundtrip_body, 2)
    assert sender == [6 * 4 + 2 * 8]
    assert receiver == [6 * 4 + 2 * 8, 15.0, 1.0]


def test_a_message_for_another_micro_batch_is_named():
    with pytest.raises(DistributedTestFailure, match="PipeMessageError.*expected the activation of micro-batch 1"):
        run_distributed(wrong_label_body, 2, timeout=40)


def test_a_gradient_of_another_dtype_is_named():
    with pytest.raises(DistributedTestFailure, match=r"PipeMessageError.*float64\[4, 8\].*needs \[float32\[4, 8\]\]"):
        run_distributed(wrong_shape_body, 2, timeout=40)


def failing_stage_body(mode: str) -> None:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    # a dead peer: the survivor must fail by name within the harness's grace after the death (3 s)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1, timeout=1 if mode == "dies" else 3))
    batches = iter([micro_batch(0, micro, 0, torch.float32) for micro in range(GAS)])
    if comm.get_rank() == 1:
        if mode == "dies":
            os._exit(3)
        if mode == "stuck":
            time.sleep(8)
        if mode == "wrong shape":  # the second stage gets an input its layers cannot take
            batches = iter([(x, y[:, :3]) for x, y in batches])
    engine.train_batch(batches)


@pytest.mark.slow  # a fresh pool of ranks after the failure
def test_a_stage_that_raises_stops_every_stage_by_name():
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(failing_stage_body, 2, "wrong shape", timeout=40)
    text = str(failure.value)
    assert "must match the size of tensor" in text  # the failing stage's own error
    assert "PipePeerFailedError" in text and "rank 0: waiting for the output gradient" in text


@pytest.mark.slow  # a fresh pool of ranks after the failure
def test_a_dead_stage_is_named():
    # Named for the lost connection (found by a receive, by the wait on one, or by a send: which one
    # meets the closed socket first is timing), or at the stage's own 1 s timeout (not at the 60 s
    # collective timeout, which would read "within the collective timeout").
    with pytest.raises(DistributedTestFailure,
                       match=r"PipePeerFailedError: rank 0: (the connection to rank 1 failed|sending message \S+ "
                             r"\S+ \S+ to rank 1 failed|waiting for .* \(rank 1\) failed)|PipeTimeoutError: .* within 1 s"):
        run_distributed(failing_stage_body, 2, "dies", timeout=120)


@pytest.mark.slow  # a fresh pool of ranks after the failure
def test_a_stuck_stage_times_out_by_name():
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(failing_stage_body, 2, "stuck", timeout=40)
    text = str(failure.value)
    # one line naming the setting that gave the wait, not the collective timeout's
    assert re.search(r"PipeTimeoutError: rank 0: the output gradient of micro-batch \d+ for stage 0 from stage 1 did "
                     r"not arrive from rank 1 within 3 s; that stage is stuck or runs another schedule "
                     r"\(zerodist\.pipeline\.timeout sets the wait\)\.\n", text), text
    assert "zerodist.timeout in the config" not in text and "collective timeout" not in text


def surface_body() -> list[str]:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss)
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1))
    refused = []
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except PipelineError as error:
            refused.append(str(error))
    batches = iter([micro_batch(0, micro, 0, torch.float32) for micro in range(GAS)])
    loss = engine.eval_batch(batches)
    engine.destroy()
    return refused + [f"{loss.item():.9f}"]


def test_forward_backward_step_refused_and_eval_batch_agrees():
    results = run_distributed(surface_body, 2)
    model = torch.nn.Sequential(*mlp_layers())
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(model(x), y).item()
                       for x, y in (micro_batch(0, micro, 0, torch.float32) for micro in range(GAS))) / GAS
    for result in results:
        assert result[:3] == ["Only train_batch() is accessible in pipeline mode."] * 3
        assert float(result[3]) == pytest.approx(expected, rel=1e-6)
    assert results[0][3] == results[1][3]


def failed_then_again_body() -> None:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, _, _, _ = zerodist.initialize(model=module, config=config(1, timeout=3))
    batches = [micro_batch(0, micro, 0, torch.float32) for micro in range(GAS)]
    first = iter([(x, y[:, :3]) for x, y in batches]) if comm.get_rank() == 1 else iter(batches)
    try:
        engine.train_batch(first)
    except Exception:  # noqa: BLE001  # a user who catches the failure and tries again
        pass
    else:
        raise AssertionError("the first batch should have failed on every stage")
    engine.train_batch(iter(batches))  # refused by name on every rank (raising tears the pool down)


@pytest.mark.slow  # a fresh pool of ranks after the failure
def test_a_failed_pipeline_refuses_to_run_again_by_name():
    """After a failed batch the stages' messages are out of step (an abort may still be queued), so
    a second train_batch on the same engine is a named error, not a mismatched message or a hang."""
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(failed_then_again_body, 2, timeout=40)
    text = str(failure.value)
    assert text.count("earlier run failed") >= 2 and "cannot run again" in text


@pytest.mark.unit
def test_a_failing_rank_aborts_every_rank_it_exchanges_messages_with():
    """With interleaving the last pipe rank's stage feeds the first rank's next one, so an abort
    goes around the ring too, not only to the pipe ranks on either side."""
    from types import SimpleNamespace

    from zerodist.pipe.executor import PipelineExecutor

    def neighbours(num_ranks: int, stages_per_rank: int, rank: int) -> list[int]:
        module = SimpleNamespace(total_stages=num_ranks * stages_per_rank, stage_id=rank)
        return PipelineExecutor(module, [10 + r for r in range(num_ranks)])._neighbour_ranks()  # type: ignore[arg-type]

    assert neighbours(3, 1, 0) == [11] and neighbours(3, 1, 1) == [10, 12] and neighbours(3, 1, 2) == [11]
    assert neighbours(3, 2, 0) == [11, 12]  # stages 0, 3: next 1 (rank 1), previous 2 (rank 2), next 4 (rank 1)
    assert neighbours(3, 2, 2) == [10, 11]  # stages 2, 5: previous 1, next 3 (rank 0), previous 4
