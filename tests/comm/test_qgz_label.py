"""qgZ's all-to-alls carry their label in a trace (`tracer.labelled`), apart from other all-to-alls."""

from __future__ import annotations

import torch

import zerodist.comm as comm
from zerodist.comm import collectives
from zerodist.comm.quantized import QGZ_LABEL, quantized_reduce_scatter
from tests.harness import distributed_test


@distributed_test(world_size=2)
def test_qgz_all_to_alls_are_labelled_and_others_are_not():
    flat = torch.arange(1024, dtype=torch.float32)
    with comm.trace() as t:
        quantized_reduce_scatter(flat, bits=4)
        collectives.all_to_all_single(torch.empty(8), torch.ones(8))
    to_all = [r for r in t.records if r.op == "all_to_all"]
    assert [r.label for r in to_all] == [QGZ_LABEL, None]
    assert t.labelled_bus_bytes(QGZ_LABEL) == to_all[0].bus_bytes > 0
    assert t.bus_bytes("all_to_all") - t.labelled_bus_bytes(QGZ_LABEL, "all_to_all") == to_all[1].bus_bytes
