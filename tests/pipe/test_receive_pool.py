"""The executor's receive buffers ([Note: receive buffer pool] in zerodist/pipe/executor.py) and its
fused I + W ([Note: split backward]; `fuse_split_backward`): on 2 gloo ranks, with activations
over the header's inline area (so every message has a payload received into a pooled buffer),
every run's gradients are bitwise one process's gradient accumulation, and after the first run
no receive allocates. The pool stays bounded: messages inside the header are never pooled, a shape
that changes between runs keeps only the last run's buffers, and evaluation leaves it alone."""

from __future__ import annotations

import copy

import pytest
import torch

import zerodist.comm as comm
from tests.harness import run_distributed
from zerodist.comm import p2p
from zerodist.pipe import PipelineExecutor, PipelineModule, build_schedule
from zerodist.pipe.executor import fuse_split_backward
from zerodist.pipe.schedule import Action, Kind, forward_only

WIDTH, MICRO, M, RUNS = 64, 32, 4, 3  # an activation of 8 KiB: over p2p.INLINE_BYTES


def _layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(7)] + [
        torch.nn.Linear(WIDTH, WIDTH)]


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(MICRO, WIDTH, generator=g) for _ in range(M)],
            [torch.randn(MICRO, WIDTH, generator=g) for _ in range(M)])


def pool_body(schedule: str) -> tuple[list[bool], list[int]]:
    assert MICRO * WIDTH * 4 > p2p.INLINE_BYTES
    layers, (inputs, labels) = _layers(), _data()
    reference = torch.nn.Sequential(*copy.deepcopy(layers))
    for x, y in zip(inputs, labels):
        (torch.nn.functional.mse_loss(reference(x), y) * (1 / M)).backward()
    v = schedule in ("zbv", "dualpipev")
    module = PipelineModule(layers, num_stages=2, stages_per_rank=2 if v else 1, partition_method="uniform",
                            loss_fn=torch.nn.functional.mse_loss, stage_placement="v" if v else "loop")
    executor = PipelineExecutor(module, [0, 1], timeout_s=60)
    actions = build_schedule(schedule, num_ranks=2, num_microbatches=M, stages_per_rank=2 if v else 1)[comm.get_rank()]
    equal, allocated = [], []
    for _ in range(RUNS):
        for layer in layers:
            for p in layer.parameters():
                p.grad = None
        executor.run(actions, inputs=inputs, labels=labels, loss_scale=1 / M)
        allocated.append(executor.pool.allocated)
        for stage in module.local_stages:
            for index in module.stage_layers(stage):
                for got, want in zip(layers[index].parameters(), reference[index].parameters()):
                    equal.append(got.grad is not None and torch.equal(got.grad, want.grad))
    return equal, allocated


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb", "zbv"])
def test_pooled_receives_are_bitwise_and_allocate_only_in_the_first_run(schedule):
    for equal, allocated in run_distributed(pool_body, 2, schedule):
        assert equal and all(equal)
        assert allocated[0] > 0 and allocated[0] == allocated[-1]


def _free(executor: PipelineExecutor) -> tuple[int, int]:
    return executor.pool.free_count, executor.pool.free_bytes


def bounded_body(schedule: str, width: int, rows: list[int], evaluate: bool) -> tuple[list[bool], list[tuple[int, int]], list[int]]:
    """Runs with `rows`-row micro-batches of `width` (a shape per run), an evaluation after each run
    when `evaluate`; the gradients against one process's, the pool's free buffers and allocations."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(4)]
    module = PipelineModule(layers, num_stages=2, partition_method="uniform", loss_fn=torch.nn.functional.mse_loss)
    reference = torch.nn.Sequential(*copy.deepcopy(layers))
    executor = PipelineExecutor(module, [0, 1], timeout_s=60)
    actions = build_schedule(schedule, num_ranks=2, num_microbatches=M)
    equal, free, allocated = [], [], []
    for run, count in enumerate(rows):
        g = torch.Generator().manual_seed(run)
        inputs = [torch.randn(count, width, generator=g) for _ in range(M)]
        labels = [torch.randn(count, width, generator=g) for _ in range(M)]
        for model in (layers, list(reference)):
            for layer in model:
                for p in layer.parameters():
                    p.grad = None
        for x, y in zip(inputs, labels):
            (torch.nn.functional.mse_loss(reference(x), y) * (1 / M)).backward()
        executor.run(actions[comm.get_rank()], inputs=inputs, labels=labels, loss_scale=1 / M)
        for index in module.stage_layers(module.stage_id):
            for got, want in zip(layers[index].parameters(), reference[index].parameters()):
                equal.append(got.grad is not None and torch.equal(got.grad, want.grad))
        if evaluate:
            executor.run(forward_only(actions)[comm.get_rank()], inputs=inputs, labels=labels, train=False)
        free.append(_free(executor))
        allocated.append(executor.pool.allocated)
    return equal, free, allocated


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_inline_messages_do_not_grow_the_pool(schedule):
    """8-wide activations travel inside the header (freshly made): never given to the pool."""
    assert 4 * 8 * 4 <= p2p.INLINE_BYTES
    for equal, free, allocated in run_distributed(bounded_body, 2, schedule, 8, [4] * 5, False):
        assert equal and all(equal)
        assert free == [(0, 0)] * 5 and allocated == [0] * 5


def test_shapes_that_change_between_runs_keep_only_the_last_runs_buffers():
    rows = [32, 33, 34, 35, 36]  # 64-wide: payload messages of 8 KiB and more
    for equal, free, _ in run_distributed(bounded_body, 2, "1f1b", 64, rows, False):
        assert equal and all(equal)
        counts = {count for count, _ in free}
        assert len(counts) == 1 and counts != {0}  # as many buffers each run, of the last run's shape
        assert [size for _, size in free] == [count * rows_ * 64 * 4 for (count, _), rows_ in zip(free, rows)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_evaluation_leaves_the_training_pool_alone(schedule):
    for equal, free, allocated in run_distributed(bounded_body, 2, schedule, 64, [32] * 4, True):
        assert equal and all(equal)
        assert len(set(free)) == 1 and free[0][0] > 0
        assert allocated[0] == allocated[-1]  # the next training step allocates nothing


@pytest.mark.unit
def test_an_i_directly_followed_by_its_w_runs_as_one_b():
    i, w = Action(Kind.I, 2, 0), Action(Kind.W, 2, 0)
    send = Action(Kind.SEND_B, 2, 0)
    assert fuse_split_backward([i, w]) == [Action(Kind.B, 2, 0)]
    assert fuse_split_backward([i, send, w]) == [i, send, w]  # the gradient is sent before W: kept split
    assert fuse_split_backward([i, Action(Kind.W, 2, 1)]) == [i, Action(Kind.W, 2, 1)]  # another micro-batch
    zb_last = build_schedule("zb", num_ranks=2, num_microbatches=4)[1]
    assert fuse_split_backward(zb_last) == zb_last  # ZB-H1's last stage defers its W's: nothing fused
