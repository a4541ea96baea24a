"""ZeRO-3's unit post-hook waits for every unfinished output a unit returns ([Note: unfinished
outputs] in zerodist/utils/unfinished.py), also inside a container (a wrapper's `(stream,)`), before
it frees the unit and arms its backward gather: released at the forward hook, the block's parked
chunks would read released placeholders."""

from __future__ import annotations

import pytest
import torch

from zerodist.compat import register_pytree_node
from zerodist.utils.unfinished import UnfinishedOutput
from zerodist.zero import schedule


class Pending(UnfinishedOutput):
    def __init__(self) -> None:
        self.callback = None

    def when_finished(self, callback) -> None:
        self.callback = callback


# as Domino's ChunkedStream is: a pytree node whose leaves are its chunks' tensors
register_pytree_node(Pending, lambda pending: ([torch.ones(4)], None), lambda leaves, context: Pending())


@pytest.mark.unit
def test_a_unit_returning_unfinished_outputs_in_a_container_is_done_when_all_have_finished(monkeypatch):
    done = []
    monkeypatch.setattr(schedule, "_finished_forward", lambda runtime, unit, grad, recompute, outputs: done.append(outputs))
    first, second, plain = Pending(), Pending(), torch.ones(1)
    schedule._post_forward(None, None, None, (), (first, [second, plain]))
    assert done == []
    first.callback([torch.zeros(2)])
    assert done == []
    second.callback([torch.zeros(3)])
    assert len(done) == 1 and sorted(t.numel() for t in done[0]) == [1, 2, 3]


@pytest.mark.unit
def test_a_unit_with_finished_outputs_is_done_at_its_forward_hook(monkeypatch):
    done = []
    monkeypatch.setattr(schedule, "_finished_forward", lambda runtime, unit, grad, recompute, outputs: done.append(outputs))
    schedule._post_forward(None, None, None, (), (torch.ones(1), {"x": torch.ones(2)}))
    assert len(done) == 1 and len(done[0]) == 2
