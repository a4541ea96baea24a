"""Test tiers and the worker pools' teardown.

[Note: test tiers] Every test is in exactly one of two tiers, declared in pyproject.toml:
`unit` (runs in the pytest process: no child process, no socket) and `multiprocess` (spawns
ranks or subprocesses); `slow` (over ~10 s on a 2-core machine) is orthogonal. A test marked
with neither is put in `multiprocess`, so a new test that forgets its marker lands in the tier
that can do anything, never in the fast one. A `unit` test that starts a process or opens a
socket fails with NotAUnitTest naming what it started, during its setup, call or
teardown (module- and session-scoped fixtures it triggers included): `pytest -m unit` then stays
runnable alone, with no port and no rank to wait for. A world of one inside the pytest process
(zerodist's in-process HashStore group) is allowed: it binds nothing the test chooses and
starts nothing.

[Note: one thread for unit tests] A unit test runs with one torch thread (the worker ranks use
one too), restored after it. Its tensors are tiny, and on a machine whose cores other jobs keep
busy, torch's default of one spinning OpenMP thread per core made the tier's longest test 20x
slower (2 s -> 43 s for the tiny GPT's overfit test on 2 loaded cores).
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.harness import close_pools

pytest_plugins = ["pytester"]  # tests/suite/test_tiers.py runs these hooks in an inner session

TIERS = ("unit", "multiprocess")


class NotAUnitTest(RuntimeError):
    pass


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_pools()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test must be selectable as multiprocess
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_markers_are_declared(config, items)
    both = []
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        if not tiers:
            item.add_marker(pytest.mark.multiprocess)
        elif len(tiers) == 2:
            both.append(item.nodeid)
    if both:
        raise pytest.UsageError("a test is either unit or multiprocess, not both: " + ", ".join(both))


def _check_markers_are_declared(config: pytest.Config, items: list[pytest.Item]) -> None:
    # What pyproject.toml's --strict-markers asks for. pytest 9.0 ignores --strict-markers given
    # in addopts (pytest-dev/pytest#14442, fixed after 9.0.3), and a misspelt `unit` would put a
    # test silently in no tier's selection; pytest's own markers and plugins' are declared too.
    declared = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    unknown = sorted({f"{mark.name} ({item.nodeid})" for item in items for mark in item.iter_markers()
                      if mark.name not in declared})
    if unknown:
        raise pytest.UsageError("markers not declared in pyproject.toml: " + ", ".join(unknown))


@pytest.hookimpl(hookwrapper=True)  # old-style wrapper: pytest 7.4, the oldest [test] allows, has it
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _unit_test_rules(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _unit_test_rules(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _unit_test_rules(item):
        yield


@contextmanager
def _unit_test_rules(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch, _one_torch_thread():
        for owner, name in _process_and_socket_starts():
            patch.setattr(owner, name, _refuse(item.nodeid, f"{_qualified(owner)}.{name}"))
        yield


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    torch = sys.modules.get("torch")  # a unit test that never imported torch does not pay for it
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _process_and_socket_starts() -> list[tuple[Any, str]]:
    # The Python-level doors that starting a process or a connection goes through here:
    # multiprocessing (any context) starts a BaseProcess, subprocess.run/check_output and torchrun
    # launches build a Popen, the harness's free port is a Python socket; TCPStore binds from C++,
    # so it is replaced by name (when torch.distributed is loaded at all).
    starts: list[tuple[Any, str]] = [
        (multiprocessing.process.BaseProcess, "start"),
        (subprocess.Popen, "__init__"),
        (socket.socket, "bind"),
        (socket.socket, "connect"),
        (socket.socket, "connect_ex"),
    ]
    starts += [(os, name) for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp") if hasattr(os, name)]
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and hasattr(distributed, "TCPStore"):
        starts.append((distributed, "TCPStore"))
    return starts


def _refuse(nodeid: str, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotAUnitTest(
            f"{nodeid} is marked unit but called {what}: a unit test starts no process and opens no socket. "
            "Mark it multiprocess (see [Note: test tiers] in tests/conftest.py).")
    return refuse


def _qualified(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, type(os)) else f"{owner.__module__}.{owner.__qualname__}"
