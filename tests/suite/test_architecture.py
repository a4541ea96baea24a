"""The import graph of `zerodist/`: no cycles, and imports only go down the layer table
(docs/design/architecture.md, "Layers").

Pure (no processes, no imports of zerodist itself): every module is parsed with `ast`. It lives at
the root of `tests/` rather than in a package folder because it exercises no one subpackage but
the graph of all of them.

What counts as an import of module A by module B:
- every `import` / `from ... import` in B, at module level or inside a function or class body
  (a function-level import is still a dependency; it only runs later);
- imports under `if TYPE_CHECKING:` too, reported as "type-only": such an import cannot fail at
  run time, but it is a dependency of the design all the same (a type checker follows it, and a
  reader cannot understand B without A), so a cycle or an upward reference through one counts;
- `zerodist.NAME` read from a bare `import zerodist`, where NAME is one of the lazy attributes
  of `zerodist/__init__.py`, as an import of the module that attribute comes from;
- `from pkg import name` is an import of `pkg.name` when that is a module, else of `pkg`.
Importing `pkg.mod` is not counted as importing `pkg/__init__.py` (Python runs it first, but
every package's `__init__` would then sit in a cycle with each of its modules).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "zerodist"

# Layer of each top-level part of the package. Imports go to a lower layer, or within one
# package; packages that share a layer do not import each other.
LAYERS = {
    "zerodist": 0,  # the lazy facade (`zerodist.initialize` ...): imports nothing at import time
    "utils": 1, "compat": 1,  # compat.py: every private torch API, importing only torch
    "runtime": 8,  # DeepSpeed's module paths (deepspeed.runtime.*, .utils, .zero) over zerodist's layers
    "config": 2,
    "comm": 3,
    "precision": 4, "accelerator": 4,  # accelerator.py: DeepSpeed's get_accelerator(), over comm's device choice
    "zero": 5, "moe": 5, "tensor_parallel": 5, "sequence": 5, "pipe": 5, "offload": 5,
    # The demo's model and data stand where a user's model does: above the building blocks they
    # may use (`models.moe_gpt` is built from `moe`'s layer), below the engine they are handed to.
    "checkpoint": 6, "debug": 6, "models": 6, "data": 6,
    "engine": 7,
    "bench": 8, "train": 8, "integrations": 8,
    "cli": 9,  # the commands (and `python -m zerodist`), over what they run: `zerodist train` runs train/
}

# Beyond the layers: which lower packages a package must not import. checkpoint/ and debug/ see
# parameters through their declared placements (comm/domains.py) and the typed ZeRO state, never
# through the technique that declared them, so a new technique needs no change there.
FORBIDDEN = {
    "checkpoint": {"moe", "tensor_parallel", "sequence", "pipe", "offload"},
    "debug": {"moe", "tensor_parallel", "sequence", "pipe", "offload"},
}

# (importing module, imported module) -> (the name of its Note, why the rule is bent). The
# importing module explains it in a `[Note: <name>]`.
EXCEPTIONS = {
    ("zerodist.tensor_parallel.apply", "zerodist.models.gpt"): (
        "demo GPT plan",
        "tensor parallelism has a built-in plan for the demo GPT and recognises it by its class; the "
        "import runs inside the function that checks, so importing tensor_parallel never imports models"),
    ("zerodist.tensor_parallel.apply", "zerodist.models.moe_gpt"): (
        "demo GPT plan",
        "the same for the demo MoE GPT's built-in plan: recognised by isinstance, imported inside the check"),
}


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool

    def __str__(self) -> str:
        kind = " (type-only)" if self.type_only else ""
        return f"{self.source} -> {self.target} ({_path(self.source)}:{self.line}){kind}"


def _path(module: str) -> str:
    file, _ = _modules()[module]
    return str(file.relative_to(ROOT.parent))


@functools.cache
def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of zerodist/."""
    found = {}
    for file in sorted(ROOT.rglob("*.py")):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return found


@functools.cache
def _facade() -> dict[str, str]:
    """The lazy attributes of `zerodist/__init__.py` -> the module each comes from."""
    tree = ast.parse(_modules()["zerodist"][0].read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                names.update({k: v[0] for k, v in ast.literal_eval(node.value).items()})
            elif node.targets[0].id == "_SUBPACKAGES":
                names.update({k: f"zerodist.{k}" for k in ast.literal_eval(node.value)})
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    modules = _modules()
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the package holding `module`
        base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]


def _edges_of(module: str) -> list[Edge]:
    file, is_package = _modules()[module]
    return _edges_in(module, is_package, file.read_text())


def _edges_in(module: str, is_package: bool, source: str) -> list[Edge]:
    """The zerodist modules that `source`, the text of `module`, imports (see the docstring above)."""
    tree = ast.parse(source)
    edges: list[Edge] = []
    bare_zerodist = False

    def visit(node: ast.AST, type_only: bool) -> None:
        nonlocal bare_zerodist
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            bare_zerodist |= any(a.name == "zerodist" and a.asname is None for a in node.names)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges.extend(Edge(module, target, node.lineno, type_only)
                         for target in _targets(module, is_package, node) if target.split(".")[0] == "zerodist")
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    if bare_zerodist:  # `zerodist.initialize` resolves lazily to zerodist.engine: that is the import
        facade = _facade()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "zerodist"
                    and node.attr in facade):
                edges.append(Edge(module, facade[node.attr], node.lineno, False))
    modules = _modules()
    return list(dict.fromkeys(e for e in edges if e.target in modules and e.target != module))


@functools.cache
def _graph() -> tuple[Edge, ...]:
    return tuple(edge for module in _modules() for edge in _edges_of(module))


def _part(module: str) -> str:
    """The top-level part of zerodist a module belongs to (`__main__` is the command line's)."""
    part = module.split(".")[1] if "." in module else "zerodist"
    return "cli" if part == "__main__" else part


def _cycles(edges: tuple[Edge, ...]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as one cycle
    through it: A -> B -> ... -> A."""
    succ: dict[str, list[str]] = {}
    for e in edges:
        succ.setdefault(e.source, []).append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted({e.source for e in edges} | {e.target for e in edges}):
        if v not in index:
            connect(v)
    return [_one_cycle(component, succ) for component in components]


def _one_cycle(component: list[str], succ: dict[str, list[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ.get(v, []):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {component}")


def _describe(cycle: list[str], edges: tuple[Edge, ...]) -> str:
    by_pair = {(e.source, e.target): e for e in edges}
    return "\n    ".join(str(by_pair[pair]) for pair in zip(cycle, cycle[1:]))


# --------------------------------------------------------------------------------------- tests
def test_every_part_of_the_package_has_a_layer():
    parts = {_part(m) for m in _modules()}
    assert parts <= set(LAYERS), f"give {sorted(parts - set(LAYERS))} a layer in LAYERS and in architecture.md"


def test_the_parser_sees_every_kind_of_import():
    """The parser on a planted module (so the other tests cannot pass on an empty graph)."""
    source = textwrap.dedent("""
        from typing import TYPE_CHECKING
        import zerodist
        import zerodist.comm as comm
        from zerodist.utils import get_logger
        from . import layout
        from .bucket import Bucket
        if TYPE_CHECKING:
            from zerodist.engine.engine import Engine

        def build():
            from zerodist.config import Config
            return zerodist.initialize, zerodist.__version__
        """)
    edges = {(e.target, e.type_only) for e in _edges_in("zerodist.zero.planted", False, source)}
    assert edges == {("zerodist.comm", False), ("zerodist.utils", False), ("zerodist.zero.layout", False),
                     ("zerodist.zero.bucket", False), ("zerodist.engine.engine", True), ("zerodist.config", False),
                     ("zerodist", False), ("zerodist.engine", False)}
    assert len(_graph()) > 300  # and the real tree has imports to check


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = (Edge("a", "b", 1, False), Edge("b", "c", 1, True), Edge("c", "a", 1, False), Edge("c", "d", 1, False),
               Edge("d", "e", 1, False))
    assert _cycles(planted) == [["a", "b", "c", "a"]]
    assert _cycles(planted[3:]) == []


def test_no_import_cycle():
    edges = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles among zerodist's modules:\n  " + "\n  ".join(
        f"{' -> '.join(c)}:\n    {_describe(c, edges)}" for c in cycles)


def test_imports_go_down_the_layers():
    wrong = []
    for edge in _graph():
        source, target = _part(edge.source), _part(edge.target)
        if source == target or (edge.source, edge.target) in EXCEPTIONS:
            continue
        if LAYERS[target] >= LAYERS[source]:
            how = "the same layer" if LAYERS[target] == LAYERS[source] else "a higher layer"
            wrong.append(f"{edge}: {source} (layer {LAYERS[source]}) imports {target}, {how} "
                         f"(layer {LAYERS[target]})")
        elif target in FORBIDDEN.get(source, ()):
            wrong.append(f"{edge}: {source} reads {target}'s parameters through their placements, not {target}")
    assert not wrong, "imports against the layer table:\n  " + "\n  ".join(sorted(wrong))


def test_the_facade_imports_nothing_at_import_time():
    """`zerodist/__init__.py` is layer 0 only because its attributes load lazily."""
    assert [str(e) for e in _graph() if e.source == "zerodist"] == []


def test_each_exception_is_still_taken_and_has_its_note():
    edges = {(e.source, e.target) for e in _graph()}
    for (source, target), (note, reason) in EXCEPTIONS.items():
        assert reason
        assert (source, target) in edges, f"{source} no longer imports {target}: drop the exception"
        file, _ = _modules()[source]
        assert f"[Note: {note}]" in file.read_text(), f"{_path(source)} should explain the import in [Note: {note}]"
