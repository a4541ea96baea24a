"""The suite's own tiers ([Note: test tiers] in tests/conftest.py), in an inner pytest session run
in this process (pytester) with the real conftest's hooks and the markers pyproject.toml declares."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

INNER_TESTS = """
import socket
import subprocess
import sys

import pytest


@pytest.mark.unit
def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.unit
def test_opens_a_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


@pytest.mark.unit
def test_pure():
    assert sum(range(4)) == 6


def test_unmarked():
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # Installed plugins stay out of the inner session: pytest-benchmark runs git when it loads,
    # which this (unit) test's own guard would refuse.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    markers = [line for line in pytestconfig.getini("markers") if line.startswith(("unit:", "multiprocess:", "slow:"))]
    assert len(markers) == 3, "pyproject.toml declares unit, multiprocess and slow"
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(f"    {line}\n" for line in markers))
    pytester.makeconftest("from tests.conftest import (pytest_collection_modifyitems, pytest_runtest_call,\n"
                          "    pytest_runtest_setup, pytest_runtest_teardown)\n")
    pytester.syspathinsert(REPO)
    return pytester


def test_a_unit_test_that_starts_a_process_or_opens_a_socket_fails_naming_the_call(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner=INNER_TESTS)
    result = inner.runpytest_inprocess("-m", "unit")
    result.assert_outcomes(passed=1, failed=2, deselected=1)
    result.stdout.fnmatch_lines(["*NotAUnitTest: test_inner.py::test_starts_a_process is marked unit but called "
                                 "subprocess.Popen.__init__*"])
    result.stdout.fnmatch_lines(["*NotAUnitTest: test_inner.py::test_opens_a_socket is marked unit but called "
                                 "socket.socket.bind*"])


def test_a_test_with_no_tier_is_multiprocess(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner=INNER_TESTS)
    result = inner.runpytest_inprocess("-m", "multiprocess", "-v")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["*test_inner.py::test_unmarked PASSED*"])


def test_both_tiers_on_one_test_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner="import pytest\n\n\n@pytest.mark.unit\n@pytest.mark.multiprocess\n"
                                "def test_both():\n    pass\n")
    result = inner.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*a test is either unit or multiprocess, not both: test_inner.py::test_both*"])


def test_a_misspelt_marker_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner="import pytest\n\n\n@pytest.mark.unti\ndef test_typo():\n    pass\n")
    result = inner.runpytest_inprocess("-m", "unit")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*markers not declared in pyproject.toml: unti (test_inner.py::test_typo)*"])
