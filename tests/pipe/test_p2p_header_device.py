"""A pipeline message's header is built, sent, received and aborted on one device, the rank's
communication device (`p2p.header_device()`, [Note: one header device] in zerodist/comm/p2p.py),
whatever device the payload is on; and the header's words survive the round trip."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerodist.comm import p2p

pytestmark = pytest.mark.unit


class _Work:
    def wait(self, *args: Any) -> None:
        pass

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def messages(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, torch.device]]:
    """Every isend/irecv as (op, tag, device), with the rank's communication device the meta device."""
    seen: list[tuple[str, int, torch.device]] = []

    def post(op: str):  # type: ignore[no-untyped-def]
        def call(tensor: torch.Tensor, *args: Any, tag: int = 0, **kwargs: Any) -> _Work:
            seen.append((op, tag, tensor.device))
            return _Work()
        return call

    monkeypatch.setattr(p2p, "ensure_initialized", lambda: None)
    monkeypatch.setattr(p2p, "device_for_rank", lambda: torch.device("meta"))
    monkeypatch.setattr(p2p.dist, "isend", post("send"))
    monkeypatch.setattr(p2p.dist, "irecv", post("recv"))
    monkeypatch.setattr(p2p.dist, "get_rank", lambda: 0)
    return seen


def test_every_header_is_on_the_communication_device(messages: list[tuple[str, int, torch.device]]) -> None:
    p2p.send_message([torch.ones(4)], 1, label=(1, 1, 0))            # inline: one message
    p2p.send_message([torch.ones(64, 64)], 1, label=(1, 1, 1))       # header, then the CPU payload
    p2p.send_abort(1)
    p2p.IncomingMessage(1, label=(1, 1, 0), describe="the activation")  # the receiver's header buffer
    headers = [(op, device) for op, tag, device in messages if tag == p2p.HEADER_TAG]
    assert headers == [("send", torch.device("meta"))] * 3 + [("recv", torch.device("meta"))]
    payloads = [(op, device) for op, tag, device in messages if tag == p2p.PAYLOAD_TAG]
    assert payloads == [("send", torch.device("cpu"))]  # the payload stays where it is


def test_header_round_trip_with_inline_tensors() -> None:
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([1, 2], dtype=torch.int32)
    message, inline = p2p._encode(0, (2, 3, 5), [a, b], torch.device("cpu"))
    assert inline
    status, label, metas, inline = p2p._decode(message, 0, "x")
    assert (status, label, inline) == (0, (2, 3, 5), True)
    assert metas == [((2, 3), torch.float32), ((2,), torch.int32)]
    got = p2p._inline_views(message, metas)
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    big = torch.zeros(64, 64, dtype=torch.float64)
    assert p2p._decode(p2p._encode(0, (1, 0, 0), [big], torch.device("cpu"))[0], 0, "x")[2:] == (
        [((64, 64), torch.float64)], False)
