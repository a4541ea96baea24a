"""Finds private torch APIs in Python source: what `zerodist/compat.py` alone may use.

A reference counts when the code (not a comment or docstring) imports from a torch module with a
private component (`torch.utils._pytree`), reaches an underscore attribute through a name bound
by a torch import (`torch._C`, `dist.distributed_c10d._get_default_store`, `torch.__future__`),
or names one of torch's private tensor, storage, op or module attributes on any object, as an
attribute or as the string given to getattr and the like (`x.untyped_storage()._cdata`,
`vars(module)["_modules"]`).
"""

from __future__ import annotations

import ast

# Private attributes of torch's own objects (Tensor, UntypedStorage, OpOverload, nn.Module), whose
# holder a scan cannot tell from the source: flagged on any object.
PRIVATE_ATTRIBUTES = frozenset({
    "_C", "_cdata", "_schema", "_modules", "_parameters", "_buffers", "_non_persistent_buffers_set",
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_load_state_dict_pre_hooks", "_grad", "_grad_fn", "_post_accumulate_grad_hooks", "_version", "_base",
    "_is_view", "_typed_storage", "_make_subclass", "_make_wrapper_subclass",
})


def _is_private(name: str) -> bool:
    return name == "__future__" or (name.startswith("_") and not name.endswith("__"))


def _torch_names(tree: ast.AST) -> set[str]:
    """The names that torch imports bind in this file (torch, dist, nn, F, TorchFunctionMode ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names
                if a.name.split(".")[0] == "torch" and any(_is_private(p) for p in a.name.split("."))]
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
        if any(_is_private(p) for p in node.module.split(".")) or any(_is_private(a.name) for a in node.names):
            return [f"from {node.module} import {', '.join(a.name for a in node.names)}"]
    return []


def private_references(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch API that `source` references."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        found += [(node.lineno, text) for text in _imports(node)]
        if isinstance(node, ast.Attribute):
            root = _root(node)
            from_torch = isinstance(root, ast.Name) and root.id in torch_names
            if (from_torch and _is_private(node.attr)) or node.attr in PRIVATE_ATTRIBUTES:
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            root = _root(target)
            if (isinstance(root, ast.Name) and root.id in torch_names and isinstance(name, ast.Constant)
                    and isinstance(name.value, str) and _is_private(name.value)):
                found.append((node.lineno, f"{node.func.id}(..., {name.value!r})"))
    return sorted(set(found))
