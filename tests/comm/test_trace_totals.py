"""A trace that keeps only totals (the demo's, around a whole run) reports what a recording trace
does, in constant memory."""

from __future__ import annotations

import torch

import zerodist.comm as comm
from tests.harness import distributed_test


@distributed_test(world_size=2)
def test_totals_only_trace_matches_the_recording_one():
    with comm.trace() as recorded, comm.trace(keep_records=False) as totals:
        for size in (3, 5, 7):
            comm.all_reduce(torch.ones(size))
        out = torch.empty(8)
        comm.all_gather(out, torch.ones(4))
        comm.barrier()
    assert totals.records == [] and len(recorded.records) == 5
    for op in (None, "all_reduce", "all_gather", "barrier"):
        assert totals.count(op) == recorded.count(op)
        assert totals.total_bytes(op) == recorded.total_bytes(op) == sum(
            r.num_bytes for r in recorded.records if op is None or r.op == op)
        assert totals.bus_elements(op) == recorded.bus_elements(op)
        assert totals.bus_bytes(op) == sum(r.bus_bytes for r in recorded.records if op is None or r.op == op)
    assert totals.summary() == recorded.summary() and totals.format_summary() == recorded.format_summary()
    assert list(totals.summary()) == ["all_reduce", "all_gather", "barrier"]
