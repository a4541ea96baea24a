"""Sharded parameters outside a gather: a named error instead of silently reading NaN.

[Note: sharded access check] A ZeRO-3 parameter outside a gather keeps its full shape but has
no values: its data is a placeholder (see [Note: sharded placeholder] in param_storage.py). torch
lets a CPU parameter's data be neither a meta tensor nor a tensor subclass, and zerodist never
replaces, re-classes or sets attributes on the user's parameters, so the parameter object
itself cannot refuse to be read. What can is a `TorchFunctionMode`: it sees every torch call
made from Python (functions, methods, property getters and setters) with its arguments.

    identity   each sharded parameter's placeholder is one NaN at an address of its own (one
               element of its group's small storage), broadcast to the full shape (all strides 0). Every alias (`p.data`, `p.detach()`,
               `p[0]`, `p.t()`) therefore has the same `data_ptr()`, and the registry maps
               data_ptr -> (placeholder, qualified name, full shape). An entry holds its
               placeholder, so an address in the registry is never a freed one reused by an
               unrelated tensor.
    lifetime   `Registration` (one per flat group) adds entries when the group reshards and
               removes them before it unshards, and when the group is garbage collected.
    the check  a call whose arguments (top level, one level into lists/tuples, keyword values)
               include a registered tensor raises `ShardedParameterError` naming the parameter,
               unless it only reads metadata (`ALLOWED`); `repr()` describes the parameter.
    cost       about 2 us per torch call made from Python while the mode is on the stack. The
               engine's forward, backward and step, and `initialize()`, take it off
               (`suspended()`), so training does not pay for it: user code between engine
               calls is what is checked. The model's own forward, run by the engine, is not:
               a forward reading a parameter of a unit other than the running one gets NaN.

The mode lives on the torch-function mode stack of the thread that runs `initialize()` and the
engine calls (torch keeps one stack per thread; other threads are not checked). It is put on,
back, or off only when the outermost `suspended()` block is left (see [Note: mode stack]),
never from a garbage-collection callback: code such as `torch.device.__exit__` pops the stack
by position. When a group is collected its entries go at once; with no entry left the mode
passes every call straight through until the next engine call takes it off the stack.

[Note: parameters being gathered] Stages 1-2 (and stage 3's persistent groups) all-gather the
updated parameters at the end of `step()` asynchronously and wait for each group only where the
next forward first uses it ([Note: overlapped parameter gather] in runtime.py). Until then
the group's flat buffer is being written by the collective, so every other reader must wait
first. The same mode does it: a group registers its buffer's address range while its gather is
pending (`PendingWrite`), and a call whose arguments (looked at as for the check above) include a
tensor whose first element lies in a pending range finishes that group's gather before the call
runs; metadata (`ALLOWED`) does not wait. So `print(model.fc.weight.sum())` or
`torch.save(model.state_dict())` between `step()` and the next forward see the gathered values.
A pending range holds its waiter (the collective's handles), never the group. Ranges do not
outlive their use: a group collected with its gather in flight waits for it then, and an engine
that issues its gathers first finishes every range whose collective is already done
(`finish_completed()`), so an engine dropped or left idle right after its step cannot keep the
mode on the stack.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from zerodist import compat


class ShardedParameterError(RuntimeError):
    """A ZeRO-3 sharded parameter's values were used outside a gather."""


class _Entry(NamedTuple):
    placeholder: torch.Tensor  # kept alive so its address stays this parameter's
    name: str
    shape: torch.Size
    # `detach()` passes too (its alias keeps the address, so using it raises): a parameter cut by
    # the served zero.Init, whose model transformers asks `state_dict()` for its keys
    aliasable: bool = False


_ENTRIES: dict[int, _Entry] = {}


class _Range(NamedTuple):
    start: int  # first byte of a flat buffer being written by a pending collective
    end: int  # one past its last byte
    finish: Callable[[], None]  # waits for the collective (and unregisters the range)
    is_complete: Callable[[], bool]  # whether the collective is done (finish() would not block)


# Pending writes by id of their registration ([Note: parameters being gathered]); a handful at most.
_PENDING: dict[int, _Range] = {}


def placeholders(shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One NaN per shape, broadcast to it (no memory), each at an address of its own: returns the
    storage (`len(shapes)` NaNs) and the placeholders, views of one element each. One small
    allocation per flat group, made once: resharding allocates nothing, and no tiny long-lived
    allocation per parameter lands among the large ones freed while a model is built."""
    nans = torch.full((len(shapes),), float("nan"), dtype=dtype, device=device)
    return nans, [nans[i].expand(shape) for i, shape in enumerate(shapes)]


class Registration:
    """The placeholders one flat group has registered."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def add(self, tensor: torch.Tensor, name: str, aliasable: bool = False) -> None:
        key = tensor.data_ptr()
        _ENTRIES[key] = _Entry(tensor, name, tensor.shape, aliasable)
        self.keys.append(key)

    def clear(self) -> None:
        for key in self.keys:
            _ENTRIES.pop(key, None)
        self.keys = []


def num_registered() -> int:
    return len(_ENTRIES)


class PendingWrite:
    """One flat buffer being written by a pending collective: while registered, a torch call (outside
    the engine's own work) that uses a tensor inside it calls `finish` first."""

    def __init__(self, buffer: torch.Tensor, finish: Callable[[], None], is_complete: Callable[[], bool]):
        start = buffer.data_ptr()
        _PENDING[id(self)] = _Range(start, start + buffer.numel() * buffer.element_size(), finish, is_complete)

    def clear(self) -> None:
        _PENDING.pop(id(self), None)


def num_pending() -> int:
    return len(_PENDING)


def finish_completed() -> None:
    """Finish the pending writes whose collectives are already done (no wait): those of an engine
    that was dropped, or is idle, right after its step would otherwise keep the check on the stack."""
    for pending in tuple(_PENDING.values()):
        if pending.is_complete():
            pending.finish()


def _active() -> bool:
    """Whether the mode has anything to do: placeholders to refuse or buffers being written."""
    return bool(_ENTRIES or _PENDING)


def _pending_of(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any] | None, nested: bool = True) -> _Range | None:
    """The pending range holding the first element of a tensor among `args` (looked at as `_find` does)."""
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            address = _address(arg)
            for pending in tuple(_PENDING.values()):  # a collected group's finalizer may clear one meanwhile
                if address is not None and pending.start <= address < pending.end:
                    return pending
        elif nested and (type(arg) is list or type(arg) is tuple):
            found = _pending_of(arg, None, False)
            if found is not None:
                return found
    return None


def _address(tensor: torch.Tensor) -> int | None:
    """The tensor's first element's address; None without storage (sparse, mkldnn, a wrapper)."""
    try:
        if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
            return tensor.data_ptr()
        with compat.disable_torch_function_subclass():
            return tensor.data_ptr()
    except RuntimeError:
        return None


def _entry_of(tensor: torch.Tensor) -> _Entry | None:
    """The slow path: a tensor subclass, looked at without its own __torch_function__, or a
    tensor without storage (sparse, mkldnn, a wrapper like DTensor), which has no entry."""
    try:
        with compat.disable_torch_function_subclass():
            return _ENTRIES.get(tensor.data_ptr())
    except RuntimeError:
        return None


def _find(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any] | None, nested: bool = True) -> _Entry | None:
    """The entry of the first registered tensor among `args`, one level into lists and tuples
    (torch.cat([p, q])), and `kwargs`' values. Runs on every torch call: kept to type checks
    and one dict lookup per tensor."""
    for arg in (*args, *kwargs.values()) if kwargs else args:
        cls = type(arg)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            try:
                entry = _ENTRIES.get(arg.data_ptr())
            except RuntimeError:
                entry = None  # no storage: sparse, mkldnn
        elif cls is list or cls is tuple:
            entry = _find(arg, None, False) if nested else None
        elif isinstance(arg, torch.Tensor):
            entry = _entry_of(arg)
        else:
            continue
        if entry is not None:
            return entry
    return None


_METADATA_PROPERTIES = ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
                        "retains_grad", "itemsize", "nbytes", "output_nr", "data", "is_cuda", "is_cpu", "is_meta",
                        "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
                        "is_xla", "is_mtia", "is_ipu", "is_maia", "is_vulkan", *compat.PRIVATE_TENSOR_PROPERTIES)
_SETTABLE = ("grad", "requires_grad", *compat.PRIVATE_TENSOR_SETTABLE)
_METADATA_METHODS = ("size", "dim", "ndimension", "numel", "nelement", "element_size", "__len__", "__hash__",
                     "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
                     "is_floating_point", "is_complex", "is_signed", "get_device", "is_shared", "is_inference",
                     *compat.PRIVATE_TENSOR_METHODS)

# What passes for a sharded parameter: its metadata and gradient bookkeeping, never its values
# nor its storage. The `.data` getter passes because the alias it returns has the placeholder's
# address, so using that alias raises; setting `.data` does not (it would cut the parameter off
# from its shards).
ALLOWED: frozenset[Any] = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _METADATA_PROPERTIES if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n).__set__ for n in _SETTABLE]
    + [getattr(torch.Tensor, n) for n in _METADATA_METHODS if hasattr(torch.Tensor, n)]
    + list(compat.PRIVATE_METADATA_FUNCTIONS)
)
_DESCRIBED = frozenset([torch.Tensor.__repr__, torch.Tensor.__format__])
_ALIASES = frozenset([torch.Tensor.detach])
# A conversion to what the placeholder already is returns it unchanged, reading nothing: `.to` with
# its own dtype and device, and `.data = itself` (nn.Module._apply sets `param.data` to whatever the
# conversion returned). axolotl calls `module.to(torch.float32)` on an fp32 model built under the
# served zero.Init; a conversion that would change the parameter is still refused.
_CONVERSIONS = frozenset([torch.Tensor.to, torch.Tensor.type])
_DATA_SET = getattr(torch.Tensor, "data").__set__


def _changes_nothing(func: Any, args: tuple[Any, ...], kwargs: Any) -> bool:
    if func == _DATA_SET:  # a method-wrapper: a new object at each lookup, equal by what it wraps
        return len(args) == 2 and args[1] is args[0]
    if func in _CONVERSIONS and args and not {"copy", "memory_format"} & set(kwargs or {}):
        # asked of a 0-d tensor of the placeholder's dtype and device (the check is off inside the mode):
        # converting the full-shape placeholder itself would allocate the whole parameter first
        probe = torch.empty((), dtype=args[0].dtype, device=args[0].device)
        return (func(probe, *args[1:], **kwargs) if kwargs else func(probe, *args[1:])) is probe
    return False


def describe(entry: _Entry) -> str:
    return (f"tensor(sharded by zerodist ZeRO-3 as '{entry.name}': full shape {tuple(entry.shape)}, "
            f"{entry.placeholder.dtype}; read it inside zerodist.zero.GatheredParameters)")


def _what(func: Any) -> str:
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    if name.endswith(".__set__"):
        return f"setting {name[:-len('.__set__')]} on it would cut it off from its shards"
    name = name.removesuffix(".__get__")
    in_place = name.endswith("_") and not name.endswith("__")
    return f"{name} {'would write to' if in_place else 'read'} it"


class ShardedAccessCheck(TorchFunctionMode):
    """Raises `ShardedParameterError` when a call uses a registered placeholder's values, and waits
    for a pending gather before a call uses the buffer it writes ([Note: parameters being gathered])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        while _PENDING and func not in ALLOWED:  # a call may use several groups being gathered
            pending = _pending_of(args, kwargs)
            if pending is None:
                break
            pending.finish()
        if _ENTRIES and not _STATE.placeholders_unchecked:
            entry = _find(args, kwargs)
            if entry is not None and func not in ALLOWED and not (entry.aliasable and func in _ALIASES):
                if _changes_nothing(func, args, kwargs):
                    return args[0]
                if func in _DESCRIBED:
                    return describe(entry)
                raise ShardedParameterError(
                    f"'{entry.name}' is a ZeRO-3 sharded parameter (full shape {tuple(entry.shape)}) and has no "
                    f"values outside a gather: {_what(func)}. Read or change it inside 'with "
                    "zerodist.zero.GatheredParameters(param[, modifier_rank=0])', or use engine.module_state_dict() "
                    "for a full copy."
                )
        return func(*args, **kwargs) if kwargs else func(*args)


_MODE = ShardedAccessCheck()


# [Note: mode stack] torch keeps one torch-function mode stack per thread, and the modes on it
# leave by popping whatever is on top: TorchFunctionMode.__exit__ and `with torch.device(...)`
# both do. So the check may only be taken off and put back exactly where it was, or put in at
# the bottom, below every mode entered after it (just above the default-device context that
# `torch.set_default_device` keeps at the very bottom). Anything else would make a later exit
# pop the check instead of its own mode.
def _stack() -> list[Any]:
    return [compat.torch_function_mode_at(i) for i in range(compat.torch_function_mode_count())]


def _set_stack(modes: list[Any]) -> None:
    while compat.torch_function_mode_count():
        compat.pop_torch_function_mode()
    for mode in modes:
        compat.push_torch_function_mode(mode)


def _install_at_bottom(stack: list[Any]) -> None:
    default_device = compat.default_device_mode()
    bottom = 1 if stack and stack[0] is default_device else 0
    _set_stack(stack[:bottom] + [_MODE] + stack[bottom:])


def _remove(stack: list[Any]) -> tuple[int, list[Any]] | None:
    """Take the check off; returns (where it was, the stack without it) to put it back, or None."""
    if _MODE not in stack:
        return None
    index = stack.index(_MODE)
    rest = stack[:index] + stack[index + 1:]
    if index == len(stack) - 1:
        compat.pop_torch_function_mode()  # the usual case: nothing above it
    else:
        _set_stack(rest)
    return index, rest


class _ThreadState(threading.local):
    depth = 0  # nesting of suspended()
    removed: tuple[int, list[Any]] | None = None  # where the outermost suspended() took the check from
    placeholders_unchecked = False  # inside suspended(waiting=True): only pending gathers are looked at


_STATE = _ThreadState()


class suspended:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Take the check off the stack inside the block (zerodist's own work: the engine's forward,
    backward and step, `initialize()`). Leaving the outermost block is a safe point: the check
    goes back where it was if parameters are registered (or gathers pending), is installed if it
    was not there yet, and stays off if none are (see [Note: mode stack]).

    `waiting=True` (the engine's forward): while a gather is pending the mode stays on, looking
    only at pending buffers, so a forward that reads a parameter before its unit's pre-hook waited
    for it waits too ([Note: parameters being gathered]); with none pending it is as without."""

    def __init__(self, waiting: bool = False):
        self.waiting = waiting

    def __enter__(self) -> None:
        state = _STATE
        state.depth += 1
        if state.depth == 1:
            if self.waiting and _PENDING:
                stack = _stack()
                if _MODE not in stack:
                    _install_at_bottom(stack)
                state.removed, state.placeholders_unchecked = None, True
                return
            length = compat.torch_function_mode_count()
            if length == 1 and compat.torch_function_mode_at(0) is _MODE:
                compat.pop_torch_function_mode()  # the usual case, without building lists
                state.removed = (0, [])
            else:
                state.removed = _remove(_stack()) if length else None

    def __exit__(self, *exc: Any) -> None:
        state = _STATE
        state.depth -= 1
        if state.depth:
            return
        removed, state.removed = state.removed, None
        state.placeholders_unchecked = False
        length = compat.torch_function_mode_count()
        active = _active()
        if active and removed == (0, []) and length == 0:
            compat.push_torch_function_mode(_MODE)  # the usual case again
            return
        stack = _stack()
        if not active:
            _remove(stack)
        elif removed is not None and stack == removed[1]:
            index, rest = removed
            _set_stack(rest[:index] + [_MODE] + rest[index:])
        elif _MODE not in stack:
            _install_at_bottom(stack)


def settle() -> None:
    """Called where the last pending gather may just have been waited for (a forward pre-hook): with
    nothing left to check, take the idle mode off the stack if it is on top, so the rest of the
    forward and the user's code after it pay nothing. Only from the top: every mode entered after
    it is then already gone, and one entered before it is still below ([Note: mode stack]). Inside
    `suspended(waiting=True)` placeholders are not checked, so only pending gathers count there;
    leaving that block puts the check back if placeholders are registered."""
    if _PENDING or (_ENTRIES and not _STATE.placeholders_unchecked):
        return
    length = compat.torch_function_mode_count()
    if length and compat.torch_function_mode_at(length - 1) is _MODE:
        compat.pop_torch_function_mode()


def is_installed() -> bool:
    """Whether the check is on this thread's torch-function mode stack."""
    return any(compat.torch_function_mode_at(i) is _MODE for i in range(compat.torch_function_mode_count()))
