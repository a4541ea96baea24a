"""Every private torch API zerodist uses, in one module, with the torch versions it was checked on.

[Note: private torch APIs] A few things zerodist does have no public torch API: keeping a
torch-function mode at a chosen depth of the mode stack, composing with the saved-tensor hooks
active outside a unit, counting who holds a storage, naming a meta storage, reading the
default store's connection, and so on. Each is reached here and only here, behind a small
named function or constant, so that a torch upgrade has one file to check and `zerodist doctor`
can say what this torch lacks (`PRIVATE_APIS`). A source scan (tests/compat/test_compat.py)
keeps every other file of the package off torch's private names.

For each entry: what it is for, the torch versions it was checked on, and what happens on a
torch without it: a fallback that keeps results right (slower or coarser), or
`UnsupportedTorchError` naming the feature and the fix when no such fallback exists. The error
is raised where the feature is used, never at import, so the rest of zerodist still works.

This module is layer 0: it imports only torch and the standard library, and every layer may
import it. `default_store()` reaches into torch.distributed; only `comm/` calls it, as only
`comm/` talks to torch.distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

CHECKED_ON = "2.13.0"


class UnsupportedTorchError(RuntimeError):
    """A zerodist feature needs a private torch API that the installed torch does not have."""


def _resolve(path: str) -> Any:
    """The object at the dotted `path` (modules imported as needed), or None where this torch has none."""
    parts = path.split(".")
    found: Any = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        if hasattr(found, part):
            found = getattr(found, part)
            continue
        try:
            found = importlib.import_module(".".join(parts[: index + 1]))
        except ImportError:
            return None
    return found


def _unsupported(feature: str, api: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"{feature} needs torch's private {api}, which torch {torch.__version__} does not have. Install a torch "
        f"zerodist was checked on ({CHECKED_ON}); `zerodist doctor` lists the private APIs this torch lacks."
    )


def _raiser(feature: str, api: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise _unsupported(feature, api)

    return missing


@dataclasses.dataclass(frozen=True)
class PrivateApi:
    """One private torch API: what zerodist uses it for and what happens without it."""

    name: str  # as torch spells it
    used_for: str
    checked_on: str
    available: bool
    without: str  # the fallback, or the feature that raises UnsupportedTorchError


_FEATURE_SHARDED_CHECK = "ZeRO-3's sharded-parameter check (zerodist.zero.sharded_access)"
_FEATURE_INIT = "recorded initialisation (zerodist.zero.Init)"
_FEATURE_SAVED_VIEWS = "ZeRO-3's saved parameter views (zerodist.zero.saved_params)"

# ---------------------------------------------------------------- pytree (torch.utils._pytree)
_PYTREE_FLATTEN = _resolve("torch.utils._pytree.tree_flatten")
_PYTREE_MAP = _resolve("torch.utils._pytree.tree_map")
# The leaves of nested containers, as torch itself walks them (containers that libraries register
# with torch's pytree, e.g. Hugging Face's ModelOutput, included). Checked on 2.13.0. Without: error.
tree_flatten: Callable[..., tuple[list[Any], Any]] = _PYTREE_FLATTEN or _raiser(
    "flattening module outputs and operation arguments", "torch.utils._pytree.tree_flatten")
tree_map: Callable[..., Any] = _PYTREE_MAP or _raiser(
    "mapping over operation arguments", "torch.utils._pytree.tree_map")
# Domino's chunked activations as a pytree node, so ZeRO-3 finds a block's output tensors
# (zerodist/tensor_parallel/domino.py). Without: initialize() refuses Domino inter at stage 3.
_PYTREE_REGISTER = _resolve("torch.utils._pytree.register_pytree_node")
pytree_registration_available = _PYTREE_REGISTER is not None


def register_pytree_node(cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]) -> None:
    if _PYTREE_REGISTER is not None:
        _PYTREE_REGISTER(cls, flatten, unflatten)

# ---------------------------------------------------------------- dispatch modes and op schemas
_DISPATCH_MODE = _resolve("torch.utils._python_dispatch.TorchDispatchMode")


class _MissingDispatchMode:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported(_FEATURE_INIT, "torch.utils._python_dispatch.TorchDispatchMode")


# The base class of `zero.Init`'s recorder: sees every aten operation, meta tensors included.
# Checked on 2.13.0. Without: building a recorder raises UnsupportedTorchError.
TorchDispatchMode: type = _DISPATCH_MODE or _MissingDispatchMode


def op_schema_arguments(op: Any) -> Any:
    """The declared arguments of an aten OpOverload (`op._schema.arguments`: name, kwarg_only,
    alias_info.is_write), to tell which arguments an operation writes. Checked on 2.13.0.
    Without: UnsupportedTorchError."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise _unsupported(_FEATURE_INIT, "OpOverload._schema")
    return schema.arguments


def storage_key(tensor: torch.Tensor) -> int:
    """An integer naming `tensor`'s storage while the storage lives (its C++ object's address,
    `untyped_storage()._cdata`): meta storages have no data address to tell them apart.
    Checked on 2.13.0. Without: UnsupportedTorchError."""
    storage = tensor.untyped_storage()
    key = getattr(storage, "_cdata", None)
    if key is None:
        raise _unsupported(_FEATURE_INIT, "UntypedStorage._cdata")
    return key


# ---------------------------------------------------------------- storage use count
_USE_COUNT = _resolve("torch._C._storage_Use_Count")


def storage_use_counter() -> Callable[[torch.Tensor], int] | None:
    """How many tensors (and the storage's Python wrapper) hold a tensor's storage: torch's own
    private counter (also used by torch's inductor), for the buffer pool. Checked on 2.13.0.
    Without: None, and the pool never hands a buffer out again (it allocates, as without a pool)."""
    counter = _USE_COUNT
    if counter is None:
        return None
    return lambda tensor: counter(tensor.untyped_storage()._cdata)


# ---------------------------------------------------------------- saved-tensor hooks
_HOOKS_ENABLED = _resolve("torch._C._autograd._saved_tensors_hooks_is_enabled")
_TOP_HOOKS = _resolve("torch._C._autograd._top_saved_tensors_default_hooks")


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be entered here (a compile transform disables them, and
    entering one then raises). Checked on 2.13.0. Without: True, as torch before the switch
    had no way to disable them."""
    return True if _HOOKS_ENABLED is None else bool(_HOOKS_ENABLED())


def outer_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The innermost saved-tensor hooks active now, (pack, unpack), or None: what a unit's hooks
    hand the tensors they do not keep to, so a user's `save_on_cpu` or a checkpoint still sees
    them. Checked on 2.13.0. Without: UnsupportedTorchError."""
    if _TOP_HOOKS is None:
        raise _unsupported(_FEATURE_SAVED_VIEWS, "torch._C._autograd._top_saved_tensors_default_hooks")
    return _TOP_HOOKS(False)


# ---------------------------------------------------------------- torch-function mode stack
# The stack of this thread's torch-function modes, read and rebuilt by position, to keep the
# sharded-parameter check where it was ([Note: mode stack] in zero/sharded_access.py). These are
# torch's builtins themselves when present (called on every engine call: no wrapper in between).
# Checked on 2.13.0. Without: each raises UnsupportedTorchError when called.
_STACK_LEN = _resolve("torch._C._len_torch_function_stack")
_STACK_AT = _resolve("torch._C._get_function_stack_at")
_STACK_POP = _resolve("torch._C._pop_torch_function_stack")
_STACK_PUSH = _resolve("torch._C._push_on_torch_function_stack")
torch_function_mode_count: Callable[[], int] = _STACK_LEN or _raiser(
    _FEATURE_SHARDED_CHECK, "torch._C._len_torch_function_stack")
torch_function_mode_at: Callable[[int], Any] = _STACK_AT or _raiser(
    _FEATURE_SHARDED_CHECK, "torch._C._get_function_stack_at")
pop_torch_function_mode: Callable[[], Any] = _STACK_POP or _raiser(
    _FEATURE_SHARDED_CHECK, "torch._C._pop_torch_function_stack")
push_torch_function_mode: Callable[[Any], None] = _STACK_PUSH or _raiser(
    _FEATURE_SHARDED_CHECK, "torch._C._push_on_torch_function_stack")

# A context manager under which a tensor subclass's own __torch_function__ is skipped, to read a
# subclass's address plainly. Checked on 2.13.0. Without: entering it raises UnsupportedTorchError.
_DISABLE_SUBCLASS = _resolve("torch._C.DisableTorchFunctionSubclass")
disable_torch_function_subclass: Callable[[], contextlib.AbstractContextManager[Any]] = _DISABLE_SUBCLASS or _raiser(
    _FEATURE_SHARDED_CHECK, "torch._C.DisableTorchFunctionSubclass")


def default_device_mode() -> Any:
    """The mode `torch.set_default_device` keeps at the bottom of the stack, or None. Checked on
    2.13.0. Without: None, and the sharded-parameter check goes in at the very bottom, below it."""
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


# Tensor attributes that only read (or set) gradient bookkeeping and metadata, never values: the
# sharded-parameter check lets them through. Checked on 2.13.0. Without: the missing ones are left
# out (a torch without them never calls them).
_TENSOR_READS = ("_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks", "_version", "_base")
_TENSOR_SETS = ("_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
_TENSOR_METHODS = ("_is_view",)
PRIVATE_TENSOR_PROPERTIES = tuple(n for n in _TENSOR_READS if hasattr(torch.Tensor, n))
PRIVATE_TENSOR_SETTABLE = tuple(n for n in _TENSOR_SETS if hasattr(torch.Tensor, n))
PRIVATE_TENSOR_METHODS = tuple(n for n in _TENSOR_METHODS if hasattr(torch.Tensor, n))
# nn.Module._apply asks whether a conversion's result may be set as `.data` (a type question, no
# values). Checked on 2.13.0. Without: left out, and a module conversion of a sharded parameter
# raises ShardedParameterError naming it (as it did before).
_SHALLOW_COPY_CHECK = _resolve("torch._has_compatible_shallow_copy_type")
PRIVATE_METADATA_FUNCTIONS = (_SHALLOW_COPY_CHECK,) if _SHALLOW_COPY_CHECK is not None else ()


# ---------------------------------------------------------------- module conversion (torch.__future__)
_GET_SWAP = _resolve("torch.__future__.get_swap_module_params_on_conversion")
_SET_SWAP = _resolve("torch.__future__.set_swap_module_params_on_conversion")


@contextlib.contextmanager
def swap_module_params_on_conversion() -> Iterator[None]:
    """Inside: `module.to_empty()` (and `.to()`) swap new storage into the existing parameter
    objects (torch.utils.swap_tensors) instead of replacing them, since the optimizer's groups and
    the user hold the originals; the flag is restored after. Checked on 2.13.0. Without:
    UnsupportedTorchError (materialising a meta module without replacing its parameters)."""
    if _GET_SWAP is None or _SET_SWAP is None:
        raise _unsupported("materialising a module built on the meta device",
                           "torch.__future__.set_swap_module_params_on_conversion")
    swap = _GET_SWAP()
    _SET_SWAP(True)
    try:
        yield
    finally:
        _SET_SWAP(swap)


# ---------------------------------------------------------------- autograd and the profiler
_GRAPH_TASK_ID = _resolve("torch._C._current_graph_task_id")


def in_backward_pass(strict: bool = True) -> bool:
    """Whether autograd's engine is running a backward pass on this thread (it has a current graph
    task; -1 elsewhere, in forwards of autograd functions included). Names the phase of tensor
    parallel collectives in the schedule log, and tells ZeRO-3 a unit's forward is an activation
    checkpoint's recompute. Checked on 2.13.0. Without: UnsupportedTorchError, or False when not
    `strict` (ZeRO-3 then frees a recomputed unit and gathers it again, as before)."""
    if _GRAPH_TASK_ID is None:
        if not strict:
            return False
        raise _unsupported("the tensor-parallel schedule log", "torch._C._current_graph_task_id")
    return _GRAPH_TASK_ID() != -1


# Whether a profiler records now: collectives are labelled (record_function, ~90 us a call even
# with no profiler) only then. torch's builtin itself (called on every collective). Checked on
# 2.13.0. Without: always True, so every collective is labelled (right, a little slower).
_PROFILER_ENABLED = _resolve("torch._C._autograd._profiler_enabled")
profiler_enabled: Callable[[], bool] = _PROFILER_ENABLED or (lambda: True)


# ---------------------------------------------------------------- torch.distributed
_DEFAULT_STORE = _resolve("torch.distributed.distributed_c10d._get_default_store")


def default_store() -> Any:
    """The default process group's key-value store (TCPStore under torchrun), which the
    collective guard and the exchange read with their own short deadlines. Called only from
    `comm/`. Checked on 2.13.0. Without: UnsupportedTorchError."""
    if _DEFAULT_STORE is None:
        raise _unsupported("the collective guard and exchange (zerodist.comm)",
                           "torch.distributed.distributed_c10d._get_default_store")
    return _DEFAULT_STORE()


# ---------------------------------------------------------------- nn.Module's registry of children
_HAS_MODULES = "_modules" in vars(torch.nn.Module())


def registered_children(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module | None]]:
    """`module`'s children as registered, in order: a child registered under two names comes
    twice, as `state_dict()` walks them (`named_children()` gives it once), and a name set to None
    comes with None. Checked on 2.13.0. Without: UnsupportedTorchError."""
    if not _HAS_MODULES:
        raise _unsupported("logical parameter names (zerodist.comm.domains)", "nn.Module._modules")
    return list(module._modules.items())


def registered_child(module: object, name: str) -> torch.nn.Module | None:
    """The child registered as `name`, read without `nn.Module.__getattr__` (for a `__getattr__`
    that falls back on it, also while `__init__` has not registered anything yet); None if none.
    Checked on 2.13.0. Without: always None."""
    return vars(module).get("_modules", {}).get(name)


# ---------------------------------------------------------------- the table `zerodist doctor` prints
def _table() -> tuple[PrivateApi, ...]:
    rows = [
        ("torch.utils._pytree.tree_flatten, tree_map", "flatten module outputs (ZeRO-3 hooks) and op arguments "
         "(zero.Init)", _PYTREE_FLATTEN is not None and _PYTREE_MAP is not None, "error"),
        ("torch.utils._pytree.register_pytree_node", "Domino's chunked block outputs seen by ZeRO-3's hooks",
         pytree_registration_available, "initialize() refuses Domino inter-layer overlap at stage 3"),
        ("torch.utils._python_dispatch.TorchDispatchMode", "record meta-device initialisation (zero.Init); count FLOPs (flops_profiler, zerodist train)",
         _DISPATCH_MODE is not None, "error in zero.Init"),
        ("OpOverload._schema", "which arguments an op writes (zero.Init)",
         hasattr(torch.ops.aten.add_.Tensor, "_schema"), "error in zero.Init"),
        ("UntypedStorage._cdata", "name meta storages (zero.Init); the buffer pool's use count",
         hasattr(torch.UntypedStorage(0), "_cdata"), "error in zero.Init"),
        ("torch._C._storage_Use_Count", "hand a ZeRO-3 buffer out again only when nothing holds it",
         _USE_COUNT is not None, "fallback: buffers are not reused"),
        ("torch._C._autograd._saved_tensors_hooks_is_enabled", "whether saved-tensor hooks may be entered",
         _HOOKS_ENABLED is not None, "fallback: assumed enabled"),
        ("torch._C._autograd._top_saved_tensors_default_hooks", "compose ZeRO-3's saved views with outer hooks",
         _TOP_HOOKS is not None, "error at a ZeRO-3 unit's forward"),
        ("torch._C._len_torch_function_stack, _get_function_stack_at, _pop_torch_function_stack, "
         "_push_on_torch_function_stack",
         "keep ZeRO-3's sharded-parameter check at its depth",
         None not in (_STACK_LEN, _STACK_AT, _STACK_POP, _STACK_PUSH), "error at ZeRO-3 engine calls"),
        ("torch._C.DisableTorchFunctionSubclass", "read a tensor subclass's address plainly",
         _DISABLE_SUBCLASS is not None, "error on a subclass argument"),
        ("torch._GLOBAL_DEVICE_CONTEXT", "keep set_default_device's mode at the bottom of the stack",
         hasattr(torch, "_GLOBAL_DEVICE_CONTEXT"), "fallback: check goes in at the bottom"),
        ("torch.Tensor._grad, _grad_fn, _backward_hooks, _post_accumulate_grad_hooks, _version, _base, "
         "_is_view", "metadata the sharded-parameter check lets through",
         len(PRIVATE_TENSOR_PROPERTIES + PRIVATE_TENSOR_METHODS) == len(_TENSOR_READS + _TENSOR_METHODS),
         "fallback: the missing ones are not allowed"),
        ("torch.__future__ swap_module_params_on_conversion", "materialise meta modules in place",
         _GET_SWAP is not None and _SET_SWAP is not None, "error materialising a meta module"),
        ("torch._C._current_graph_task_id", "phase of tensor-parallel collectives in the schedule log; "
         "ZeRO-3 keeps a unit recomputed in backward gathered", _GRAPH_TASK_ID is not None,
         "error in tensor-parallel collectives; ZeRO-3 gathers a recomputed unit once more"),
        ("torch._C._autograd._profiler_enabled", "label collectives only while a profiler records",
         _PROFILER_ENABLED is not None, "fallback: always labelled"),
        ("torch.distributed.distributed_c10d._get_default_store", "the guard's and exchange's store reads",
         _DEFAULT_STORE is not None, "error in the guard and exchange"),
        ("torch.nn.Module._modules", "children registered twice (logical names); the engine's __getattr__",
         _HAS_MODULES, "error in logical names"),
    ]
    return tuple(PrivateApi(name, used_for, CHECKED_ON, available, without)
                 for name, used_for, available, without in rows)


PRIVATE_APIS: tuple[PrivateApi, ...] = _table()
