"""Imported once, by the test suite's forkserver only (tests.processes.warm_context): what every
rank of a test imports, and what the first optimizer step and config load import lazily
(torch._dynamo alone takes seconds: torch.optim imports it in every step), so that a rank forked
from the server starts in a fraction of a second instead of seconds of imports per rank.

Only imports and one step on one thread with tiny tensors: no thread pool, socket or process group
exists to be broken by the fork."""

import importlib

import torch

import zerodist
import zerodist.checkpoint  # noqa: F401
import zerodist.comm  # noqa: F401


def _warm_up() -> None:
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")
    param = torch.zeros(3, requires_grad=True)
    param.grad = torch.ones(3)
    torch.optim.AdamW([param]).step()
    zerodist.Config.load({})
    for module in ("zerodist.engine", "tests.engine_helpers", "tests.harness", "pytest"):  # what test bodies import
        importlib.import_module(module)


try:
    _warm_up()
except Exception:  # noqa: BLE001 (a warm-up that fails leaves the ranks to import for themselves: slower, not wrong;
    pass  # forkserver would swallow it anyway, but an error here must not take the server and every test down)
