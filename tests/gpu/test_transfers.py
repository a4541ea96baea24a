"""The accelerator's transfer surface on the CPU ([Note: transfers behind the accelerator] and [Note: a
simulated device] in zerodist/accelerator.py): streams and events are no-ops, host buffers are not
pinned, and the simulated device is distinct from the host only inside its block."""

from __future__ import annotations

import pytest
import torch

from zerodist.accelerator import get_accelerator, simulated_device, simulating

pytestmark = pytest.mark.unit


def test_the_cpu_is_the_host_except_while_simulated():
    accelerator = get_accelerator()
    assert accelerator.is_host(torch.device("cpu")) and not simulating()
    with simulated_device():
        assert not accelerator.is_host(torch.device("cpu")) and simulating()
    assert accelerator.is_host(torch.device("cpu"))
    assert not accelerator.is_host(torch.device("meta"))


def test_cpu_streams_run_at_once_and_events_are_complete():
    accelerator = get_accelerator()
    stream = accelerator.transfer_stream(torch.device("cpu"))
    assert not stream.asynchronous
    source, target = torch.arange(8.0), torch.zeros(8)
    stream.start_after_compute()
    with stream.inside():
        target.copy_(source)
    event = stream.record()
    assert event.done()
    event.wait_host()
    event.wait_compute()
    assert torch.equal(target, source)


def test_host_buffers_are_pinned_only_for_cuda():
    buffer = get_accelerator().host_empty(16, torch.float32)
    assert buffer.device.type == "cpu" and buffer.numel() == 16
    assert buffer.is_pinned() == (torch.cuda.is_available() and get_accelerator().pin_memory())


@pytest.mark.gpu
def test_cuda_transfer_stream_overlaps_and_its_event_orders_the_compute_stream():
    stream = get_accelerator().transfer_stream(torch.device("cuda", 0))
    assert stream.asynchronous
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    device = torch.empty_like(host, device="cuda")
    with stream.inside():
        device.copy_(host, non_blocking=True)
    stream.record().wait_compute()
    assert torch.equal(device.sum().cpu(), host.sum())
