"""Recorded initialisation: build on the meta device, replay each tensor's own history later.

[Note: recorded init] `zerodist.zero.Init` builds a model on the meta device so that no rank
ever holds it whole. An eager build's values come from whatever the model's code did to each
tensor: factory calls, in-place initialisers (`normal_`, `zeros_`, `copy_`), computations
(a rotary table), several of them in turn (a constructor's draw, then Hugging Face's
`post_init` re-draw), each random one from the position the global RNG stream had reached.
On the meta device none of this computes anything, so `Init` records it: a dispatch mode logs
every operation that reads or writes a meta tensor, in order, with the RNG state before each
random one. A random operation also runs once on a scratch CPU tensor of the same shape, so
the RNG stream advances exactly as in the eager build (the next draw, and the caller's state
after the block, are the eager ones); the scratch is freed at once. Materialisation then
replays, for one module at a time, just the operations its tensors' storages went through, each
random one from its recorded state: the same kernels on the same shapes from the same states,
so the same bits, and at most one module's tensors (plus their temporaries) exist at a time.

Tensors are identified by their meta storage (kept alive by the log, so an address is never
reused); a parameter or buffer is a view (size, stride, offset) of one. Replay runs on the CPU,
where the eager build would have drawn, and the result is moved to the target device.

Hugging Face models skip their weight initialisation when built on the meta device
(`init_weights` probes the device context). An eager build runs it at the end of each
`PreTrainedModel` constructor (`post_init`), before the weights are tied. The recorder calls the
model's own `initialize_weights()` at the same point of the stream (the first torch call after
`post_init` began, which is its device probe), so those operations are logged as an eager build
would have run them.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from zerodist.compat import TorchDispatchMode, op_schema_arguments, storage_key, tree_flatten, tree_map

META = torch.device("meta")
REPLAY_DEVICE = torch.device("cpu")


class InitReplayError(RuntimeError):
    """A tensor built under `zerodist.zero.Init` whose initialisation cannot be replayed."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    """A meta tensor as a view of a recorded storage, read at log position `seq`."""

    root: _Root
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    seq: int


@dataclasses.dataclass(frozen=True)
class _GeneratorState:
    """An explicit `generator=` argument: its state before the operation."""

    state: torch.Tensor


@dataclasses.dataclass(eq=False)
class _Event:
    seq: int
    func: Any  # an aten OpOverload
    args: tuple
    kwargs: dict
    rng_state: torch.Tensor | None  # the default CPU generator's state before a random op
    default_dtype: torch.dtype


@dataclasses.dataclass(eq=False)
class _Root:
    """One meta storage: the operation that created it and, in order, those that wrote into it."""

    storage: Any  # the meta UntypedStorage, held so that its address stays unique
    created_by: _Event | None
    output_index: int
    layout: tuple[tuple[int, ...], tuple[int, ...], int]  # the created tensor's size, stride, offset
    dense: bool = False  # the created tensor is its whole storage, each element once
    mutations: list[_Event] = dataclasses.field(default_factory=list)
    mutation_seqs: list[int] = dataclasses.field(default_factory=list)


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


class InitLog:
    """Every operation on meta tensors made under one `Init` block, in order."""

    def __init__(self) -> None:
        self.roots: dict[int, _Root] = {}
        self.seq = 0

    @classmethod
    def merged(cls, logs: list[InitLog]) -> InitLog:
        """One log holding the storages of `logs` (a model built in several `Init` blocks), to be
        continued as one. Each recorded event keeps its references to its own storages, so their
        replay is unchanged; operations recorded from now on are numbered after every event of
        every log, so they read each storage in its final state."""
        merged = cls()
        for log in logs:
            for key, root in log.roots.items():
                if key not in merged.roots or merged.roots[key].created_by is None:
                    merged.roots[key] = root
            merged.seq = max(merged.seq, log.seq)
        return merged

    def root_of(self, tensor: torch.Tensor) -> _Root | None:
        return self.roots.get(storage_key(tensor))

    def ref(self, tensor: torch.Tensor, seq: int) -> _TensorRef:
        key = storage_key(tensor)
        root = self.roots.get(key)
        if root is None:  # a meta tensor made outside the block: it has no history to replay
            root = self.roots[key] = _Root(tensor.untyped_storage(), None, 0, _layout(tensor))
        return _TensorRef(root, tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()), seq)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.seq += 1
        seq = self.seq
        random = torch.Tag.nondeterministic_seeded in func.tags
        rng_state = torch.get_rng_state() if random and kwargs.get("generator") is None else None
        event = _Event(seq, func, *self._freeze((args, kwargs), seq), rng_state, torch.get_default_dtype())
        if random:
            _advance_rng(func, args, kwargs)
        for value in _written_arguments(func, args, kwargs):
            if _is_meta(value):
                root = self.ref(value, seq).root
                root.mutations.append(event)
                root.mutation_seqs.append(seq)
        outputs, _ = tree_flatten(out)
        for index, value in enumerate(outputs):
            if _is_meta(value) and storage_key(value) not in self.roots:
                self.roots[storage_key(value)] = _Root(value.untyped_storage(), event, index, _layout(value),
                                                        _is_dense(value))

    def _freeze(self, args_kwargs: tuple[tuple, dict], seq: int) -> tuple[tuple, dict]:
        """Arguments as they must be replayed: meta tensors as references into the log, real
        tensors copied (the caller may change them later), generators as their current state."""

        def freeze(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self.ref(value, seq) if value.is_meta else value.detach().clone()
            if isinstance(value, torch.Generator):
                return _GeneratorState(value.get_state())
            return value

        return tree_map(freeze, args_kwargs)


def _layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset())


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    written = []
    for position, argument in enumerate(op_schema_arguments(func)):
        if argument.alias_info is not None and argument.alias_info.is_write:
            if argument.kwarg_only or position >= len(args):
                written.append(kwargs.get(argument.name))
            else:
                written.append(args[position])
    return [w for value in written for w in tree_flatten(value)[0]]


def _on_replay_device(value: Any) -> Any:
    return REPLAY_DEVICE if isinstance(value, torch.device) and value.type == "meta" else value


# [Note: scratch above the mmap threshold] glibc raises its mmap threshold to the size of any
# mmapped block freed that is at most 32 MiB; later allocations below it then come from the heap,
# which fragments and holds on to freed memory. Scratch tensors freed during Init would thus make
# the materialisation that follows keep far more resident memory than an eager build's. Every
# scratch therefore lives in a block above 32 MiB, which never moves the threshold; only the
# pages a draw touches become resident.
_SCRATCH_MIN_BYTES = 64 * 2**20


def _scratch_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor of `tensor`'s size, stride and dtype."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.size(), tensor.stride()) if size > 0)
    span = span if tensor.numel() else 0
    nbytes = max((span + tensor.storage_offset()) * tensor.element_size(), _SCRATCH_MIN_BYTES)
    block = torch.empty(nbytes // tensor.element_size() + 1, dtype=tensor.dtype, device=REPLAY_DEVICE)
    return block.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


def _advance_rng(func: Any, args: tuple, kwargs: dict) -> None:
    """Run a random op once on scratch CPU tensors of the same shapes, dtypes and strides: the
    generator moves on exactly as the eager build's did, and the scratch is dropped (see
    [Note: scratch above the mmap threshold])."""

    def scratch(value: Any) -> Any:
        if _is_meta(value):
            return _scratch_like(value)
        return _on_replay_device(value)

    func(*tree_map(scratch, args), **tree_map(scratch, kwargs))


class _Recorder(TorchDispatchMode):
    def __init__(self, log: InitLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(_is_meta(v) for v in tree_flatten((args, kwargs, out))[0]):
            self.log.record(func, args, kwargs, out)
        return out


class _PretrainedInit(TorchFunctionMode):
    """Runs a Hugging Face model's own `initialize_weights()` where its `post_init` would have
    (see [Note: recorded init]): at the first torch call after `post_init` began."""

    def __init__(self) -> None:
        super().__init__()
        self.candidates: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.running = False

    def note(self, module: torch.nn.Module) -> None:
        base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
        if base is not None and isinstance(module, base):
            self.candidates.add(module)

    def flush(self) -> None:
        if self.running:
            return
        self.running = True
        try:
            for model in [m for m in self.candidates if _post_init_began(m)]:
                self.candidates.discard(model)
                _check_not_tied_yet(model)
                model.initialize_weights()  # type: ignore[operator]  # a Hugging Face PreTrainedModel's
        finally:
            self.running = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.candidates:
            self.flush()
        return func(*args, **(kwargs or {}))


def _post_init_began(model: torch.nn.Module) -> bool:
    # post_init sets all_tied_weights_keys first and initialises (flagging the model) last.
    return "all_tied_weights_keys" in vars(model) and not getattr(model, "_is_hf_initialized", False)


def _check_not_tied_yet(model: torch.nn.Module) -> None:
    for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            tied = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:
            continue
        if tied:
            raise InitReplayError(
                f"{type(model).__name__} was built under zerodist.zero.Init() but its weights were tied before its "
                f"initialisation could be replayed ('{target}' is already '{source}'), so the partitioned build cannot "
                "reproduce the eager one; build it outside Init, or build it under Init and load its weights with "
                "zerodist.zero.load_pretrained()")


class Recording:
    """The state of one `Init` block: its log, and the hooks and modes that fill it.

    `Recording(log)` continues an earlier block's log (see [Note: recording continued]); it
    does not run Hugging Face initialisations again, which the first block already recorded."""

    def __init__(self, log: InitLog | None = None) -> None:
        self.log = log if log is not None else InitLog()
        self.modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._pretrained = _PretrainedInit()
        self._continued = log is not None
        self._handles: list[Any] = []
        self._modes: list[Any] = []

    def __enter__(self) -> Recording:
        registry = torch.nn.modules.module
        self._handles = [
            registry.register_module_parameter_registration_hook(lambda m, n, p: self._remember(m, p)),
            registry.register_module_buffer_registration_hook(lambda m, n, b: self._remember(m, b)),
            registry.register_module_module_registration_hook(self._remember_submodule),
        ]
        self._modes = [torch.device("meta"), *([] if self._continued else [self._pretrained]), _Recorder(self.log)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and not self._continued:
                self._pretrained.flush()
        finally:
            for mode in reversed(self._modes):
                mode.__exit__(None, None, None)
            for handle in self._handles:
                handle.remove()

    def _remember(self, module: torch.nn.Module, tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.is_meta:
            self.modules.add(module)

    def _remember_submodule(self, module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
        self._pretrained.note(module)
        if submodule is not None:
            self._pretrained.note(submodule)
            # A module made by copy.deepcopy (MoE's expert copies) registered its tensors without the
            # parameter hooks; its meta tensors' history (a clone of the original's) is in the log.
            for inner in submodule.modules():
                own = [*inner.parameters(recurse=False), *inner.buffers(recurse=False)]
                if any(t.is_meta for t in own):
                    self.modules.add(inner)


# In-place ops whose result does not depend on the values they overwrite.
_OVERWRITING = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "log_normal_",
                          "cauchy_", "geometric_", "bernoulli_"})


def _last_overwrite(root: _Root, wanted: int) -> int:
    """The index of the last of the first `wanted` mutations that overwrites the whole storage
    without reading it (0 if none): replay can start there. An eager Hugging Face build draws
    every weight twice (constructor, then `post_init`); only the second draw decides its value."""
    for index in range(wanted - 1, -1, -1):
        event = root.mutations[index]
        if event.func.overloadpacket.__name__ not in _OVERWRITING:
            continue
        written = [v for v in _written_arguments(event.func, event.args, event.kwargs) if isinstance(v, _TensorRef)]
        others = [v for v in tree_flatten((event.args, event.kwargs))[0]
                  if isinstance(v, _TensorRef) and v.root is root and all(v is not w for w in written)]
        target = written[0] if len(written) == 1 else None
        if target is not None and not others and _covers(target, root):
            return index
    return 0


def _covers(ref: _TensorRef, root: _Root) -> bool:
    """Whether `ref` is the root's own layout and that layout is every element of the storage once."""
    return root.dense and (ref.size, ref.stride, ref.offset) == root.layout


def _is_dense(tensor: torch.Tensor) -> bool:
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.size(), tensor.stride())) if tensor.numel() else 0
    return (tensor.storage_offset() == 0 and span == tensor.numel()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


class Replayer:
    """Recomputes recorded tensors on the CPU. One per module materialised: its cache holds the
    temporaries of that module only."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, int]] = {}  # id(root) -> (real storage view, mutations applied)

    def final_value(self, log: InitLog, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The value `tensor` (a meta tensor recorded in `log`) has at the end of the log."""
        root = log.root_of(tensor)
        if root is None or root.created_by is None:
            raise InitReplayError(f"{what} is on the meta device but was not created under zerodist.zero.Init(), "
                                  "so there is nothing to replay")
        ref = _TensorRef(root, tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()), sys.maxsize)
        try:
            return self._value(ref)
        except InitReplayError:
            raise
        except Exception as error:
            raise InitReplayError(f"replaying the initialisation of {what} failed: {type(error).__name__}: {error}. "
                                  "Build this model outside zerodist.zero.Init(), or give the module a "
                                  "reset_parameters() and build it on the meta device yourself") from error

    def _value(self, ref: _TensorRef) -> torch.Tensor:
        return self._storage_at(ref.root, ref.seq).as_strided(ref.size, ref.stride, ref.offset)

    def _storage_at(self, root: _Root, seq: int) -> torch.Tensor:
        """The root's tensor with exactly the mutations before `seq` applied."""
        wanted = bisect.bisect_left(root.mutation_seqs, seq)
        cached = self._cache.get(id(root))
        if cached is not None and cached[1] > wanted:  # a read of an older state: recompute apart
            return Replayer()._storage_at(root, seq)
        if cached is None:
            cached = self._cache[id(root)] = (self._create(root), _last_overwrite(root, wanted))
        base, applied = cached
        for index in range(applied, wanted):
            event = root.mutations[index]
            written = _written_arguments(event.func, event.args, event.kwargs)
            if sum(isinstance(v, _TensorRef) for v in written) > 1:
                raise InitReplayError(f"{event.func} writes several recorded tensors at once; "
                                      "replaying it is not supported")
            self._run(event)
            self._cache[id(root)] = (base, index + 1)
        return base

    def _create(self, root: _Root) -> torch.Tensor:
        if root.created_by is None:
            raise InitReplayError("a tensor it depends on was made on the meta device outside zerodist.zero.Init()")
        value = tree_flatten(self._run(root.created_by))[0][root.output_index]
        size, stride, offset = root.layout
        if (tuple(value.size()), tuple(value.stride()), value.storage_offset()) != root.layout:
            laid_out = torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
            laid_out.copy_(value)  # the CPU kernel chose another layout than the meta one: keep the recorded one
            value = laid_out
        return value.as_strided(size, stride, offset)

    def _run(self, event: _Event) -> Any:
        def thaw(value: Any) -> Any:
            if isinstance(value, _TensorRef):
                return self._value(value)
            if isinstance(value, _GeneratorState):
                generator = torch.Generator(device=REPLAY_DEVICE)
                generator.set_state(value.state)
                return generator
            return _on_replay_device(value)

        args, kwargs = tree_map(thaw, (event.args, event.kwargs))
        if event.rng_state is not None:
            torch.set_rng_state(event.rng_state)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(event.default_dtype)
        try:
            with torch.no_grad():
                return event.func(*args, **kwargs)
        finally:
            torch.set_default_dtype(dtype)
