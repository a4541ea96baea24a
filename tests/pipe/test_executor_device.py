"""The pipeline executor moves a micro-batch's inputs and labels to the rank's device at F, whatever
their structure: a tensor, tuples and lists of them, and a dict (HF-style `{"input_ids": ...}`)."""

from __future__ import annotations

import pytest
import torch

from zerodist.pipe.executor import _on

pytestmark = pytest.mark.unit


def test_every_tensor_of_a_nested_micro_batch_moves_and_the_rest_stays() -> None:
    meta = torch.device("meta")
    batch = {"input_ids": torch.ones(2, 3), "extra": [torch.zeros(1), (torch.ones(1), "tag")], "n": 4}
    moved = _on(batch, meta)
    assert set(moved) == {"input_ids", "extra", "n"} and moved["n"] == 4
    assert moved["input_ids"].device == meta and moved["input_ids"].shape == (2, 3)
    assert moved["extra"][0].device == meta and isinstance(moved["extra"], list)
    assert moved["extra"][1][0].device == meta and moved["extra"][1][1] == "tag" and isinstance(moved["extra"][1], tuple)
    cpu = torch.ones(1)
    assert _on(cpu, torch.device("cpu")) is cpu  # already there: no copy
