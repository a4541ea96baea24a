"""Stage 3's buffer pool ([Note: buffer pool] in zerodist/zero/buffer_pool.py)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.models import GPT, gpt_config
from zerodist.zero.buffer_pool import MAX_WAITING, BufferPool
from tests.engine_helpers import base_config
from tests.harness import distributed_test

STAGE3 = {"stage3_param_persistence_threshold": 0}


@pytest.mark.unit
def test_a_buffer_given_back_is_handed_out_again_for_the_same_size_only():
    pool = BufferPool()
    first = pool.take(1000, torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    pool.give(first)
    del first
    assert pool.take(999, torch.float32, torch.device("cpu")).data_ptr() != ptr  # another size: a new one
    assert pool.take(1000, torch.float64, torch.device("cpu")).data_ptr() != ptr  # another dtype
    again = pool.take(1000, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == ptr and pool.reused == 1 and pool.free_bytes == 0


@pytest.mark.unit
def test_a_buffer_someone_else_still_holds_waits_until_they_let_go():
    pool = BufferPool()
    buffer = pool.take(1000, torch.float32, torch.device("cpu"))
    kept = buffer[10:20]  # e.g. a view autograd saved (retain_graph=True), or gloo's thread for a moment
    ptr = buffer.data_ptr()
    pool.give(buffer)
    del buffer
    assert pool.free_bytes == 0 and pool.waiting_bytes == 4000 and pool.held_when_given == 1
    other = pool.take(1000, torch.float32, torch.device("cpu"))
    assert other.data_ptr() != ptr  # never handed out while held
    del kept
    assert pool.free_bytes == 4000 and pool.waiting_bytes == 0
    assert pool.take(1000, torch.float32, torch.device("cpu")).data_ptr() == ptr  # once let go, reused
    assert pool.allocated_bytes == 8000


@pytest.mark.unit
def test_at_most_max_waiting_buffers_wait_and_the_oldest_is_freed_with_its_last_holder():
    pool = BufferPool()
    kept, storages = [], []
    for _ in range(MAX_WAITING + 1):
        buffer = pool.take(1000, torch.float32, torch.device("cpu"))
        kept.append(buffer[:1])
        storages.append(weakref.ref(buffer.untyped_storage()))
        pool.give(buffer)
    del buffer
    assert pool.waiting_bytes == MAX_WAITING * 4000 == pool.allocated_bytes
    del kept[0]
    gc.collect()
    assert storages[0]() is None  # dropped by the pool: freed with its last holder, as without the pool
    kept.clear()
    pool.clear()
    gc.collect()
    assert all(s() is None for s in storages) and pool.allocated_bytes == 0


@pytest.mark.unit
def test_clear_frees_the_idle_buffers():
    pool = BufferPool()
    buffers = [pool.take(1000, torch.float32, torch.device("cpu")) for _ in range(3)]
    assert pool.allocated_bytes == pool.peak_bytes == 3 * 4000
    storages = [weakref.ref(b.untyped_storage()) for b in buffers]
    for buffer in buffers[:2]:
        pool.give(buffer)
    del buffer
    buffers = buffers[2:]
    pool.clear()
    gc.collect()
    assert [s() is None for s in storages] == [True, True, False]
    assert pool.allocated_bytes == 4000 and pool.free_bytes == 0


def _ids(step: int) -> torch.Tensor:
    rank = comm.get_rank()
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))[2 * rank: 2 * rank + 2]


@distributed_test(world_size=2)
def test_stage3_reuses_the_same_buffers_every_step_and_destroy_frees_them():
    """After the first step, gathered and staging buffers come from the pool: gathered units'
    buffers become staging buffers, and the pool holds no more than was in use at once, plus one
    for each buffer that came back still held for a moment. destroy() frees what it holds."""
    for reuse in (10**9, 0):
        torch.manual_seed(0)
        engine, _, _, _ = zerodist.initialize(model=GPT(gpt_config("tiny", n_layers=4)), config=base_config(
            3, zero_optimization={**STAGE3, "stage3_max_reuse_distance": reuse}))
        groups = [g for u in engine.stage3.units for g in u.groups]
        pool = groups[0].buffer_pool
        assert pool is not None and all(g.buffer_pool is pool for g in groups)
        used: list[set[int]] = []
        original_take = pool.take

        def take(*args, **kwargs):
            buffer = original_take(*args, **kwargs)
            used[-1].add(buffer.untyped_storage().data_ptr())
            return buffer

        pool.take = take  # an instance attribute on our own object, removed below
        for step in range(4):
            used.append(set())
            ids = _ids(step)
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step()
        del pool.take
        allocated = pool.allocated_bytes
        # After the first step, the pool allocates only where a buffer came back while something else
        # still held it for a moment (gloo's worker thread: 0 to 4 times in 4 steps here), and takes it
        # back later.
        assert len(used[1] | used[2] | used[3]) <= len(used[1]) + pool.held_when_given, used
        largest = max(b.span.numel for g in groups for b in g.buckets) * 4
        # every unit gathered at once (reuse) at most, plus a staging buffer of each size (root, block),
        # plus one for each buffer that came back held
        assert allocated <= (sum(u.numel for u in engine.stage3.units) * 4 + 2 * largest
                             + pool.held_when_given * largest), allocated
        assert pool.reused >= 3 * len(engine.stage3.units)
        deadline = time.monotonic() + 5
        while pool.waiting_bytes and time.monotonic() < deadline:  # the holder lets go within ms
            time.sleep(0.01)
        assert pool.waiting_bytes == 0
        engine.destroy()
        assert pool.free_bytes == 0 and pool.allocated_bytes == 0
