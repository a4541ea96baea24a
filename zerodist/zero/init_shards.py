"""Partitioned construction for the served ``deepspeed.zero.Init``: each parameter keeps only this
rank's shard as soon as its module's ``__init__`` has returned.

[Note: partitioned construction] ``with deepspeed.zero.Init(...)`` (served by zerodist, and entered by
transformers under ZeRO-3) builds the model eagerly on the CPU, one module at a time, and cuts each
module's own parameters down to this rank's shard as soon as that module is built:

    when       torch's global registration hooks (parameter, buffer, submodule) fire all through a
               model's construction. At each of them (and when the block ends) every module that
               owns parameters and whose ``__init__`` is no longer running (no ``__init__`` frame on
               the stack has it as ``self``) is partitioned. A layer's ``Linear`` is thus cut when
               the layer assigns it (``self.q = Linear(...)`` registers a submodule), before the
               next layer is built, also inside ``nn.ModuleList([Layer() for ...])``: the peak is
               about one module's own parameters plus 1/world of the model. Buffers stay whole
               (DeepSpeed does not partition them either).
    values     rank 0's, as DeepSpeed's ``Init`` does (it broadcasts each parameter from rank 0):
               the ranks compare digests of the parameters they are about to cut (one small
               all-gather per batch) and only those some rank built otherwise are broadcast, so
               ranks seeded alike (or not) hold the shards of one model; random init
               draws from the global RNG as an eager build does, so rank 0's model is the
               one-process build with the same seed. Each parameter's (name, shape, dtype) go with
               its digest: ranks that built different parameters raise one named error on every rank.
    which      only the modules built on the thread that entered the block (torch's hooks are
               process-wide), and only floating parameters (an integer one stays whole, as buffers
               do). `refuse` (the served Init: a PipelineModule, which builds only its stage) is
               raised as such a module is built, before its collectives. ``copy.deepcopy`` of a
               built (cut) submodule inside an ``__init__`` raises ``ShardedParameterError``: such
               a model is built with ``enabled=False``.
    shard      the flattened parameter in ``world`` equal chunks (the last zero-padded); this rank
               keeps chunk ``rank``. The parameter itself is given the placeholder ZeRO-3 uses
               ([Note: sharded placeholder] in param_storage.py: one NaN broadcast to the full
               shape) and registered with the access check ([Note: sharded access check]), so its
               values used outside a gather raise ``ShardedParameterError`` naming it (``detach()``
               passes, as ``.data`` does, since transformers reads ``model.state_dict()`` for its
               keys; the alias has the placeholder's address, so using it raises). Nothing is
               set on the parameter or its module: the shard lives in this module's side table.
    gather     ``GatheredParameters`` all-gathers the shards into a full tensor the parameter points
               at, and on leaving (with ``modifier_rank``) broadcasts that rank's values and cuts
               the shard again; nested blocks keep a parameter whole until the outermost ends.
    adoption   ``initialize()`` (``build_groups`` in partition.py) walks the modules as it does
               for a meta-built model and gathers each module's shards just before its unit is
               flattened (and at stage 3 sharded again by the flat layout): the model is never
               whole on a rank, the peak is the shards plus about one unit, as for a meta build.
               The per-parameter chunks are not the flat layout's shards (which pad buckets), so
               the unit is gathered rather than taken over as it is. With tensor, pipeline or
               expert parallelism the whole model is restored first (``restore_all``): those read or
               slice the full values, and deal modules differently to the ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import zerodist.comm as comm
from zerodist.zero import sharded_access


@dataclasses.dataclass(eq=False)
class _Shard:
    shard: torch.Tensor  # this rank's chunk of the flattened parameter, zero-padded
    shape: torch.Size
    name: str
    placeholder: torch.Tensor
    registration: sharded_access.Registration
    gathered: int = 0  # how many GatheredParameters blocks hold it whole now
    finalizer: Any = None  # clears the registration should the parameter be dropped (tied away)


# parameter -> its _Shard: zerodist's own bookkeeping, never on the parameter
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _world() -> tuple[int, int]:
    if not comm.is_initialized():
        return 1, 0
    return comm.get_world_size(), comm.get_rank()


def entry(param: torch.Tensor) -> _Shard | None:
    return _SHARDS.get(param)


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether `param` was cut by the served ``zero.Init`` and is not inside a gather now."""
    found = _SHARDS.get(param)
    return found is not None and found.gathered == 0


def holds_any(module: torch.nn.Module) -> bool:
    return any(p in _SHARDS for p in module.parameters())


def partitioned_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s partitioned parameters this rank holds (their shards)."""
    seen = {id(p): _SHARDS.get(p) for p in module.parameters()}
    return sum(e.shard.numel() * e.shard.element_size() for e in seen.values() if e is not None)


def _chunk(numel: int, world: int) -> int:
    return max(1, -(-numel // world))


def partition_all(params: list[tuple[torch.nn.Parameter, str]]) -> None:
    """Cut each of `params` (named) to this rank's shard of rank 0's values, and make its data the
    placeholder. Ranks that built the same values (the same seed) compare 16-byte digests, one small
    all-gather for the lot, and only a parameter some rank built otherwise is broadcast from rank 0:
    a broadcast's receive buffers, freed among the shards, would raise the build's peak memory."""
    world, _ = _world()
    if world > 1 and params:
        with torch.no_grad():
            for param in _differing(params):
                _broadcast_into(param, 0)
    for param, name in params:
        partition(param, name)


def _digest(tensor: torch.Tensor) -> bytes | None:
    if tensor.device.type != "cpu":
        return None  # compared by broadcasting
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(flat.numpy().data, digest_size=16).digest()


def _differing(params: list[tuple[torch.nn.Parameter, str]]) -> list[torch.nn.Parameter]:
    """The parameters some rank built with other values than rank 0. Each rank's (name, shape,
    dtype) go with its digests: ranks that built different parameters are refused on every rank."""
    signature = [(name, tuple(p.shape), str(p.dtype)) for p, name in params]
    digests = [_digest(p) for p, _ in params]
    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, (signature, digests))
    for rank, (theirs, _) in enumerate(everyone):
        if theirs != everyone[0][0]:
            first = next((i for i, pair in enumerate(zip(theirs, everyone[0][0])) if pair[0] != pair[1]),
                         min(len(theirs), len(everyone[0][0])))
            mine = everyone[0][0][first] if first < len(everyone[0][0]) else "nothing"
            other = theirs[first] if first < len(theirs) else "nothing"
            raise RuntimeError(f"deepspeed.zero.Init: rank {rank} built other parameters than rank 0 ({other} "
                               f"where rank 0 built {mine}); every rank must build the same model under the "
                               "served Init (build it alike on every rank, or pass enabled=False)")
    return [p for i, (p, _) in enumerate(params)
            if digests[i] is None or any(d[i] != everyone[0][1][i] for _, d in everyone)]


def partition(param: torch.nn.Parameter, name: str) -> None:
    """Keep this rank's shard of `param` and make its data the placeholder (no collective: the
    ranks already agree, `partition_all`)."""
    world, rank = _world()
    with torch.no_grad():
        shard = _cut(param.detach().contiguous().reshape(-1), world, rank)
    _, (placeholder,) = sharded_access.placeholders([tuple(param.shape)], param.dtype, param.device)
    record = _Shard(shard, param.shape, name, placeholder, sharded_access.Registration())
    _SHARDS[param] = record
    param.data = placeholder
    record.registration.add(placeholder, name, aliasable=True)
    record.finalizer = weakref.finalize(param, record.registration.clear)  # dropped (tied away): leaves the check


def _cut(flat: torch.Tensor, world: int, rank: int, into: torch.Tensor | None = None) -> torch.Tensor:
    chunk = _chunk(flat.numel(), world)
    low, high = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
    shard = _SLABS.take(chunk, flat.dtype, flat.device) if into is None else into
    shard[high - low:].zero_()
    shard[: high - low].copy_(flat[low:high])
    return shard


# [Note: shards in slabs] The full parameters a build frees lie among the shards it keeps. With
# one allocation per shard, glibc serves the shards from the holes and the heap, and, having
# raised its mmap threshold on the first freed block (see [Note: scratch above the mmap
# threshold] in replay_init.py), keeps the freed parameters' memory: measured, a build's peak RSS
# rose above the eager build's. The shards are therefore views into slabs of at least 64 MiB (an
# mmapped block above the threshold's 32 MiB cap, so it never moves it); a slab goes when its last
# shard does (after `initialize()` adopted them all).
_SLAB_BYTES = 64 * 2**20


class _Slabs:
    def __init__(self) -> None:
        self.current: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, int]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        slab, used = self.current.get(key, (None, 0))
        if slab is None or used + numel > slab.numel():
            size = max(numel, _SLAB_BYTES // torch.empty((), dtype=dtype).element_size())
            slab, used = torch.empty(size, dtype=dtype, device=device), 0
        self.current[key] = (slab, used + numel)
        return slab[used: used + numel]

    def close(self) -> None:
        """No further shards go into the current slabs (the block ended)."""
        self.current = {}


_SLABS = _Slabs()


def _full(record: _Shard, device: torch.device | None = None) -> torch.Tensor:
    """The whole parameter on `device` (default: where its shard is), gathered on the backend's
    device ([Note: collectives on the backend's device])."""
    world, _ = _world()
    device = record.shard.device if device is None else device
    if world == 1:
        return record.shard[: record.shape.numel()].to(device).clone().view(record.shape)
    shard = record.shard.to(comm.device_for_rank())
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard)
    return out[: record.shape.numel()].view(record.shape).to(device)


# [Note: collectives on the backend's device] The served Init builds on the CPU, but NCCL moves only
# CUDA tensors: each collective here runs on `comm.device_for_rank()` (the CPU under gloo, where the
# copies are no-ops and the results bitwise those of a CPU collective) and its result is copied back.
def _broadcast_into(param: torch.Tensor, src: int) -> None:
    """`param`'s values become rank `src`'s (under no_grad)."""
    values = param.detach().contiguous().to(comm.device_for_rank())
    comm.broadcast(values, src=src)
    if values.data_ptr() != param.data_ptr():
        param.data.copy_(values)


def _ordered(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, _Shard]]:
    unique = {id(p): p for p in params if isinstance(p, torch.Tensor)}
    return [(p, e) for p in unique.values() if (e := _SHARDS.get(p)) is not None]


def gather(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Make the partitioned ones among `params` whole (every rank, same order); returns them."""
    held = _ordered(params)
    for param, record in held:
        record.gathered += 1
        if record.gathered == 1:
            full = _full(record)
            record.registration.clear()  # first: the check refuses setting the data of a registered one
            param.data = full
    return [p for p, _ in held]


def release(params: Iterable[torch.Tensor], modifier_rank: int | None) -> None:
    """End one gather of `params`: with `modifier_rank`, that rank's values become everyone's
    shards; the outermost gather's end makes them placeholders again."""
    held = [(p, r) for p, r in _ordered(params) if r.gathered]
    if modifier_rank is not None:
        _check_unchanged(held, modifier_rank)
    for param, record in held:
        if modifier_rank is not None:
            _publish(param, record, modifier_rank)
        record.gathered -= 1
        if record.gathered == 0:
            param.data = record.placeholder
            record.registration.add(record.placeholder, record.name, aliasable=True)


def _check_unchanged(held: list[tuple[torch.Tensor, _Shard]], modifier_rank: int) -> None:
    """The modifier's (shape, dtype) of each parameter, sent to every rank first (one small
    broadcast), so that a change of either raises the same error on every rank, never a hang."""
    world, _ = _world()
    sent: list[Any] = [[(tuple(p.shape), str(p.dtype)) for p, _ in held]]
    if world > 1 and held:
        comm.broadcast_object_list(sent, src=modifier_rank)
    for (param, record), (shape, dtype) in zip(held, sent[0]):
        if shape != tuple(record.shape) or dtype != str(param.dtype):
            raise RuntimeError(f"'{record.name}' changed shape or dtype inside GatheredParameters on rank "
                               f"{modifier_rank} ({tuple(record.shape)}, {param.dtype} -> {shape}, {dtype}); "
                               "a partitioned parameter may change its values only: build the model with the "
                               "new shape instead")


def _publish(param: torch.Tensor, record: _Shard, modifier_rank: int) -> None:
    world, rank = _world()
    with torch.no_grad():
        if world > 1:
            _broadcast_into(param, modifier_rank)
        _cut(param.detach().reshape(-1).to(record.shard.dtype), world, rank, into=record.shard)


def restore(module: torch.nn.Module, device: torch.device) -> None:
    """`module`'s own partitioned parameters whole again, on `device`, and out of the table (the
    engine holds them from now on): ``initialize()``'s adoption, one module at a time."""
    for param, record in _ordered(module.parameters(recurse=False)):
        full = param.detach() if record.gathered else _full(record, device)
        record.registration.clear()
        record.finalizer.detach()
        del _SHARDS[param]
        param.data = full.to(device)


def restore_all(model: torch.nn.Module) -> None:
    """All of `model`'s partitioned parameters whole again where their shards are, every rank in
    the same order: before a technique that reads or slices the full values (tensor or pipeline
    parallelism, expert dealing), which would otherwise read the NaN placeholders."""
    for module in model.modules():
        held = _ordered(module.parameters(recurse=False))
        if held:
            restore(module, held[0][1].shard.device)


def move_unpartitioned(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to(device)` for all but the partitioned parameters (which `restore` moves): the
    buffers, and any parameter built outside the block."""
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    setattr(module, name, buffer.to(device))
            for param in module.parameters(recurse=False):
                if param not in _SHARDS and param.device != device:
                    param.data = param.data.to(device)


def rename(root: torch.nn.Module) -> None:
    """Name `root`'s partitioned parameters by their path in it (errors then name the model's path)."""
    for name, param in root.named_parameters():
        record = _SHARDS.get(param)
        if record is not None and record.name != name:
            record.registration.clear()
            record.name = name
            if record.gathered == 0:
                record.registration.add(record.placeholder, name, aliasable=True)


def _building(refuse: Callable[[object], str | None] | None = None) -> set[int]:
    """ids of the objects whose ``__init__`` is running now (on this thread's stack); `refuse`
    (an object -> why it cannot be built here, or None) raises for any of them."""
    found: set[int] = set()
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount:
            obj = frame.f_locals.get(code.co_varnames[0])
            why = refuse(obj) if refuse is not None else None
            if why is not None:
                raise RuntimeError(why)
            found.add(id(obj))
        frame = frame.f_back
    return found


class _Construction:
    """One served ``Init`` block: the modules seen owning parameters, cut once built.

    Pending modules are held strongly until cut, so which modules are cut at each event depends on
    the code alone, never on when garbage is collected: every rank cuts the same batches, in the
    same order (each batch is one collective)."""

    def __init__(self, refuse: Callable[[object], str | None] | None = None) -> None:
        self.refuse = refuse  # checked on every module being built (before any of its collectives)
        self.thread = threading.get_ident()  # torch's hooks are process-wide: only this thread's build is cut
        self.pending: dict[int, torch.nn.Module] = {}
        self.children: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.owners: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> None:
        # The hook runs before the parameter is in the module: cut it at a later event (or the end).
        if threading.get_ident() != self.thread:
            return
        if not self.pending:
            _building(self.refuse)  # else settle checks
        self.settle(keep=module)
        if param is not None:
            self.owners.add(module)
            self.pending.setdefault(id(module), module)

    def on_submodule(self, module: torch.nn.Module, name: str, submodule: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        self.owners.add(module)
        if submodule is not None:
            self.children.add(submodule)
        self.settle()

    def settle(self, everything: bool = False, keep: torch.nn.Module | None = None) -> None:
        if not self.pending or (not everything and threading.get_ident() != self.thread):
            return
        building = set() if everything else _building(self.refuse)
        if keep is not None:
            building.add(id(keep))
        with sharded_access.suspended():  # leaving it puts the access check on the stack
            self._cut_built(building)

    def _cut_built(self, building: set[int]) -> None:
        cut: list[tuple[torch.nn.Parameter, str]] = []
        taken: set[int] = set()
        for key, module in list(self.pending.items()):
            if key in building:
                continue
            del self.pending[key]
            for pname, param in module.named_parameters(recurse=False):
                # non-floating ones (an integer table) stay whole, as buffers do
                if (param not in _SHARDS and not param.is_meta and id(param) not in taken
                        and param.is_floating_point()):
                    taken.add(id(param))
                    cut.append((param, f"{type(module).__name__}.{pname}"))
        partition_all(cut)

    def finish(self) -> None:
        self.settle(everything=True)
        with sharded_access.suspended():
            for root in [m for m in self.owners if m not in self.children]:
                rename(root)


@contextlib.contextmanager
def partitioned_construction(refuse: Callable[[object], str | None] | None = None) -> Iterator[None]:
    """The served ``zero.Init`` block ([Note: partitioned construction]); `refuse(obj)` says why a
    module being built cannot be partitioned (None: it can), raised on every rank as it is built."""
    construction = _Construction(refuse)
    hooks = torch.nn.modules.module
    handles = [hooks.register_module_parameter_registration_hook(construction.on_parameter),
               hooks.register_module_buffer_registration_hook(lambda m, n, b: construction.settle()),
               hooks.register_module_module_registration_hook(construction.on_submodule)]
    try:
        yield
    except BaseException:
        _SLABS.close()
        raise
    finally:
        for handle in handles:
            handle.remove()
    try:
        construction.finish()  # not after an error: the model is not used then
    finally:
        _SLABS.close()


# [Note: external parameters] DeepSpeed's `register_external_parameter(module, param)` says that
# `module`'s forward reads `param`, which another module owns, so ZeRO-3 must gather it then too.
# zerodist's plan puts such a parameter in the root unit (as it does a weight tied across units),
# which stays gathered for the whole step: every forward can read it. Registered before
# `initialize()`. The table is keyed weakly by the reading module, never by the parameter (a weak
# reference to a parameter would stop `swap_tensors` materialising a meta-built model), and nothing
# is set on either.
_EXTERNAL: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]] = weakref.WeakKeyDictionary()


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:  # DeepSpeed's name
    """`module`'s forward reads `param`, which another module owns ([Note: external parameters])."""
    if not isinstance(module, torch.nn.Module) or not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter(module, parameter) takes an nn.Module and an nn.Parameter, "
                        f"got {type(module).__name__} and {type(param).__name__}")
    params = _EXTERNAL.setdefault(module, [])
    if all(p is not param for p in params):
        params.append(param)


def unregister_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Undo `register_external_parameter(module, param)`."""
    params = _EXTERNAL.get(module, [])
    if all(p is not param for p in params):
        raise ValueError(f"unregister_external_parameter: the parameter (shape {tuple(param.shape)}) was not "
                         f"registered as external to this {type(module).__name__}")
    params[:] = [p for p in params if p is not param]


def external_ids(model: torch.nn.Module) -> set[int]:
    """ids of the parameters registered as external to a module of `model`."""
    return {id(p) for module in model.modules() for p in _EXTERNAL.get(module, [])}
