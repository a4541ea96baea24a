"""Library code never calls print: only the CLI (zerodist/cli/) and the benchmarks' printers
(zerodist/bench/) write to the terminal; `zerodist train`'s report is a `TrainOutcome` that the
CLI renders."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "zerodist"
ALLOWED = ("cli", "bench")


@pytest.mark.unit
def test_no_print_outside_the_cli_and_bench():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "print in library code (return the text, or log it): " + ", ".join(found)
