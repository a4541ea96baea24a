"""`SwappedOptimizer`: a torch optimizer whose per-element state lives in swap files.

    step():  for each sub-group i ([Note: sub-groups] in subgroups.py)
                 read sub-group i's state from its file into a host buffer   (read-ahead: i+1
                 step the inner optimizer on views of the sub-group's pieces   is read, and i-1
                 write the buffer back to the file                             written, meanwhile)

It wraps the torch optimizer zerodist builds over the flat shards (any elementwise one: Adam,
AdamW, SGD with momentum, Adagrad, ...), so the arithmetic is torch's own, on CPU tensors, and
the result is bitwise the in-memory step's: the same kernel runs on the same elements with the
same operands ([Note: sub-groups] says why the cuts do not change a bit). Between steps host
memory holds no per-element state at all, only the scalars (Adam's `step`).

[Note: swapped state is real state] Everything that reads an optimizer's state reads the real
values: `state[tensor]` reads that tensor's state back from the swap files (the checkpoint's
shards are collected that way), `state_dict()` returns the inner optimizer's with the state read
back, and `load_state_dict()` writes what it is given to the swap files. So a checkpoint saved
with offload is a plain checkpoint (it loads with or without offload, at any world size), and a
resume rebuilds the swap files from it. The class is named after the inner optimizer's (an
offloaded AdamW is an `AdamW` to a checkpoint), for the same reason.

[Note: stepped values swapped] The values being stepped can live in the files too: the fp32
master under bf16/fp16, and stage 3's parameter shard with `offload_param: nvme` (handed over
once with `hold_values`, through zerodist/zero/stepped_store.py's protocol, which this module
implements without importing zero). They are the first region of each sub-group file (only the
held pieces, in piece order); a held piece is stepped on a view of that region of the buffer, not
on the real tensor (which holds no memory any more), and whoever handed it over is told its new
values right after (`notify(start, values)`: the cast into the bf16 parameters). `read_values` /
`write_values` reach a held tensor's elements between steps (a gather, a checkpoint).

[Note: failures agreed] A read or write that fails (a full disk, a truncated or missing file) is
an `OffloadError` on the rank where it happened; the step then compares one flag over the group
(one small all-reduce per step) and every rank raises the same named error, instead of the
others hanging in the next collective. The last committed checkpoint is untouched: checkpoints
are never written to or through the swap files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import zerodist.comm as comm
from zerodist.comm.collectives import Group
from zerodist.offload import errors
from zerodist.offload.host import prefer_foreach
from zerodist.offload.wrapped import WrappedOptimizer
from zerodist.offload.subgroups import SubGroup, plan_subgroups
from zerodist.offload.stream import SwapStream
from zerodist.offload.swap_files import SwapDirectory

_REGION_ALIGN = 64  # bytes: each state kind's region of a sub-group file starts on a cache line


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """How sub-groups are streamed through host buffers (`offload_optimizer` and `sub_group_size`)."""

    sub_group_size: int
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False


@dataclasses.dataclass(frozen=True)
class Kind:
    """One per-element state tensor of the optimizer (Adam: `exp_avg`, `exp_avg_sq`)."""

    key: str
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="cpu").element_size()


class SwappedState(Mapping[torch.Tensor, dict[str, Any]]):
    """The optimizer's `state`, read back from the swap files on access ([Note: swapped state is real state])."""

    def __init__(self, owner: SwappedOptimizer):
        self._owner = owner

    def __getitem__(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self._owner.read_state(tensor)

    def __contains__(self, tensor: object) -> bool:
        return tensor in self._owner.scalars

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(list(self._owner.scalars))

    def __len__(self) -> int:
        return len(self._owner.scalars)


_CLASSES: dict[type, type] = {}


def swapped(inner: torch.optim.Optimizer, directory: SwapDirectory, settings: StreamSettings,
            group: Group = None) -> SwappedOptimizer:
    """`inner` with its per-element state in `directory`'s swap files."""
    cls = type(inner)
    if cls not in _CLASSES:  # named after the inner class ([Note: swapped state is real state])
        _CLASSES[cls] = type(cls.__name__, (SwappedOptimizer,), {"__module__": __name__,
                                                                 "__qualname__": f"SwappedOptimizer[{cls.__name__}]"})
    optimizer: SwappedOptimizer = _CLASSES[cls](inner, directory, settings, group)
    return optimizer


class SwappedOptimizer(WrappedOptimizer):
    """Steps `inner` one sub-group at a time on state read from swap files. `param_groups` are the
    inner optimizer's own (a scheduler's learning rate reaches it)."""

    def __init__(self, inner: torch.optim.Optimizer, directory: SwapDirectory, settings: StreamSettings,
                 group: Group = None):
        # The base class sets up its hooks over a placeholder parameter, whose group is discarded: until
        # `inner` is set, `param_groups` and `state` are scratch (see their setters).
        super().__init__([torch.zeros(1, device="cpu")], inner.defaults)
        self.inner, self.directory, self.settings, self.group = inner, directory, settings, group
        self.scalars: dict[torch.Tensor, dict[str, Any]] = {}  # per tensor with state: its non-elementwise state
        self.kinds: tuple[Kind, ...] | None = None  # known after the first step (torch initialises state lazily)
        self._plan: list[SubGroup] = []
        self._plan_key: tuple[int, ...] = ()
        self._on_disk = False  # every sub-group's file holds its state
        # Tensors whose values live in the files too ([Note: stepped values swapped]), each with the
        # function told of its new values after each piece is stepped; their pieces' places in the values region.
        self.held: dict[torch.Tensor, Callable[[int, torch.Tensor], None] | None] = {}
        self._value_slots: dict[int, list[int | None]] = {}
        self._value_itemsize = 4
        # The host buffers and the I/O threads, with reads and writes in flight across steps
        # ([Note: swap I/O across steps] in stream.py): whatever reads the files drains its writes first.
        self._stream = SwapStream(directory, settings.buffer_count, settings.pipeline_read, settings.pipeline_write)
        prefer_foreach(inner)

    @property
    def _host_buffers(self) -> list[torch.Tensor]:
        return self._stream.buffers

    @property
    def io_wait_s(self) -> float:
        """Time the step spent blocked on reads and writes, all steps."""
        return self._stream.io_wait_s

    def settle(self) -> None:
        """Wait for the swap writes still in flight after a step ([Note: swap I/O across steps])."""
        self._stream.settle()

    @property
    def read_depth(self) -> int:
        """Sub-groups read ahead, sized from the measured read and step times ([Note: swap I/O across steps])."""
        return self._stream.read_depth

    # ------------------------------------------------------------------ torch.optim.Optimizer's surface
    @property  # type: ignore[override]
    def state(self) -> SwappedState:
        return SwappedState(self)

    @state.setter
    def state(self, value: Any) -> None:
        if "inner" in self.__dict__:
            raise AttributeError("a swapped optimizer's state is set with load_state_dict()")

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with the state read back from the swap files."""
        self._check_plan()
        self._stream.drain(keep_reads=True)
        full = {tensor: self.read_state(tensor) for tensor in self.scalars}
        self.inner.state.update(full)
        try:
            return self.inner.state_dict()
        finally:
            for tensor in full:
                self.inner.state.pop(tensor, None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load through the inner optimizer (its casts and checks), then move the state to the swap files
        (collective, as `step()` is: a write that fails on one rank is the same error on every rank)."""
        self.inner.load_state_dict(state_dict)
        self._check_plan()
        loaded = dict(self.inner.state)
        self.inner.state.clear()
        failure: errors.OffloadError | None = None
        try:
            self._absorb(loaded)
        except errors.OffloadError as error:
            failure = error
        self._agree(failure)

    def close(self) -> None:
        """Stop the I/O threads and remove the swap files (the engine's `destroy()`)."""
        try:
            self._stream.close()
        finally:
            self.directory.close()

    def resident_state_bytes(self) -> int:
        """Bytes of per-element optimizer state held in memory between steps (none: it is in the files;
        the scalars, such as Adam's step, are not counted, as `ZeroOptimizer.state_bytes` counts none)."""
        return sum(v.numel() * v.element_size() for s in self.scalars.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def swapped_state_bytes(self) -> int:
        """Bytes of per-element state in the swap files (what one step reads and writes)."""
        return sum(self._file_bytes(sg) for sg in self._plan) if self.kinds or self.held else 0

    # ------------------------------------------------------------------ stepped values in the files
    def hold_values(self, tensors: Mapping[torch.Tensor, Callable[[int, torch.Tensor], None] | None]) -> None:
        """From now on `tensors`' values live in the swap files ([Note: stepped values swapped]): their
        current values are written there; the caller drops its own copy. `notify(start, values)`, when
        given, is told each piece's new values after it is stepped. Once, before the first step."""
        self._check_plan()
        if self.held or self.scalars or self._on_disk:
            raise errors.OffloadError("a swapped optimizer takes the values it holds once, before its first step")
        stepped = {id(t) for t in self._flat_params()}
        if any(id(t) not in stepped for t in tensors) or len({t.dtype for t in tensors}) > 1:
            raise errors.OffloadError("held values must be tensors this optimizer steps, all of one dtype")
        self.held = dict(tensors)
        self._value_itemsize = next(iter(tensors)).element_size() if tensors else 4
        params = [group["params"] for group in self.inner.param_groups]
        for sub_group in self._plan:
            slots: list[int | None] = []
            at = 0
            for piece in sub_group.pieces:
                held = params[piece.group][piece.position] in self.held
                slots.append(at if held else None)
                at += piece.length if held else 0
            if at:
                self._value_slots[sub_group.index] = slots
        self._allocate_buffers()
        for tensor in self.held:
            self.write_values(tensor, 0, tensor.detach())

    def read_values(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of held `tensor`, read from the files into `out`."""
        self._stream.drain(keep_reads=True)
        for index, offset, low, high in self._held_ranges(tensor, start, out.numel()):
            self.directory.read(index, out[low - start: high - start], offset=offset, whole=False)

    def write_values(self, tensor: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Overwrite elements [start, start + values.numel()) of held `tensor` in the files."""
        values = values.detach().reshape(-1).to(tensor.dtype).contiguous()
        self._stream.drain()  # a read ahead of this file would hold the old values
        for index, offset, low, high in self._held_ranges(tensor, start, values.numel()):
            self.directory.write_at(index, values[low - start: high - start], offset)

    def agree(self, failure: Exception | None) -> None:
        """Every rank raises when any rank's read or write of held values failed ([Note: failures agreed]);
        the others raise an `OffloadError` of the same name when it is one, else a plain `OffloadError`."""
        self._agree(failure)

    def _held_ranges(self, tensor: torch.Tensor, start: int, numel: int) -> Iterator[tuple[int, int, int, int]]:
        """(file index, byte offset, first, end) of the pieces of `tensor`'s elements [start, start + numel)."""
        if tensor not in self.held:
            raise KeyError("this tensor's values are not held in the swap files")
        for sub_group, position in self._pieces_of(tensor):
            piece, slot = sub_group.pieces[position], self._value_slots[sub_group.index][position]
            low, high = max(start, piece.start), min(start + numel, piece.start + piece.length)
            if low < high and slot is not None:
                yield sub_group.index, (slot + low - piece.start) * self._value_itemsize, low, high

    def _values_bytes(self, sub_group: SubGroup, aligned: bool = True) -> int:
        """Bytes of the held values region that starts a sub-group's file (0 when it holds none);
        `aligned`: rounded up to where the state regions start, else the values' own bytes."""
        slots = self._value_slots.get(sub_group.index)
        if not slots:
            return 0
        exact = sum(p.length for p, slot in zip(sub_group.pieces, slots) if slot is not None) * self._value_itemsize
        return -(-exact // _REGION_ALIGN) * _REGION_ALIGN if aligned else exact

    def _value_view(self, buffer: torch.Tensor | None, slot: int, length: int) -> torch.Tensor:
        assert buffer is not None, "held values are stepped in a host buffer"
        dtype = next(iter(self.held)).dtype
        return buffer[slot * self._value_itemsize: (slot + length) * self._value_itemsize].view(dtype)

    def _flat_params(self) -> list[torch.Tensor]:
        return [t for group in self.inner.param_groups for t in group["params"]]

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("a swapped optimizer takes no closure (zerodist's engine never passes one)")
        failure: errors.OffloadError | None = None
        try:
            self._check_plan()
            new_scalars: dict[torch.Tensor, dict[str, Any]] = {}
            if self._on_disk and self.kinds:
                self._step_streamed(new_scalars)
            else:
                self._step_first(new_scalars)
            self.scalars.update(new_scalars)
        except errors.OffloadError as error:
            failure = error
        self._agree(failure)

    def _step_first(self, new_scalars: dict[torch.Tensor, dict[str, Any]]) -> None:
        """No state on disk yet: the inner optimizer initialises it; each sub-group is written as stepped
        (held values are read from their region first, and written back with the state)."""
        self._stream.drain()
        unwritten: list[SubGroup] = []  # stepped before the state kinds were known (no gradient yet)
        for sub_group in self._plan:
            values = self._values_bytes(sub_group)
            buffer = self._host_buffers[0] if values else None
            if buffer is not None:  # the file may hold the values only, unpadded (before the first step)
                self.directory.read(sub_group.index, buffer[: self._values_bytes(sub_group, aligned=False)],
                                    whole=False)
            states = self._step_sub_group(sub_group, buffer, new_scalars)
            if not self.kinds:  # known from the first sub-group whose pieces got state (a piece without a
                kinds = _kinds_of(states)  # gradient gets none, and must not decide it for the others)
                if kinds:
                    self.kinds = kinds
                    self._allocate_buffers()
                    if buffer is not None:  # the stepped values move into the new, larger buffer
                        self._host_buffers[0][:values].copy_(buffer[:values])
            if not self.kinds:  # no per-element state (plain SGD, or none yet): only held values to write
                if buffer is not None:
                    self.directory.write_at(sub_group.index, buffer[:values], 0)
                unwritten.append(sub_group)
                continue
            buffer = self._host_buffers[0]
            self._pack(sub_group, buffer, states)
            self.directory.write(sub_group.index, buffer[: self._file_bytes(sub_group)])
        if self.kinds:  # every file whole: the state regions of pieces without state are never read
            for sub_group in unwritten:
                buffer = self._host_buffers[0]
                buffer[: self._file_bytes(sub_group)].zero_()
                if self._values_bytes(sub_group):
                    self.directory.read(sub_group.index, buffer[: self._values_bytes(sub_group, aligned=False)],
                                        whole=False)
                self.directory.write(sub_group.index, buffer[: self._file_bytes(sub_group)])
        self._on_disk = bool(self.kinds)

    def _step_streamed(self, new_scalars: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Read, step, write each sub-group, with read-ahead and write-behind as configured ([Note: swap
        I/O across steps] in stream.py)."""
        def step(sub_group: SubGroup, buffer: torch.Tensor) -> None:
            self._pack(sub_group, buffer, self._step_sub_group(sub_group, buffer, new_scalars))

        self._stream.stream(self._plan, self._file_bytes, step)

    def _step_sub_group(self, sub_group: SubGroup, buffer: torch.Tensor | None,
                        new_scalars: dict[torch.Tensor, dict[str, Any]]) -> list[dict[str, Any] | None]:
        """Step the inner optimizer on this sub-group's pieces only (views of the real tensors and
        their gradients), with state on views of `buffer`; returns each piece's state after it."""
        params = [group["params"] for group in self.inner.param_groups]
        slots = self._value_slots.get(sub_group.index)  # held pieces are stepped in the buffer's values region
        pieces: list[torch.Tensor | None] = []
        group_params: list[list[torch.Tensor]] = [[] for _ in params]
        for position, piece in enumerate(sub_group.pieces):
            tensor = params[piece.group][piece.position]
            if tensor.grad is None:  # torch skips a tensor without a gradient; so does every piece of it
                pieces.append(None)
                continue
            slot = None if slots is None else slots[position]
            view = (tensor.detach()[piece.start: piece.start + piece.length] if slot is None
                    else self._value_view(buffer, slot, piece.length))
            view.grad = tensor.grad.detach()[piece.start: piece.start + piece.length]
            if tensor in self.scalars:  # else the optimizer initialises the piece's state (the first step)
                state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.scalars[tensor].items()}
                if buffer is not None and self.kinds:
                    state.update(self._views(sub_group, buffer, position))
                self.inner.state[view] = state
            group_params[piece.group].append(view)
            pieces.append(view)
        saved = [group["params"] for group in self.inner.param_groups]
        try:
            for group, chosen in zip(self.inner.param_groups, group_params):
                group["params"] = chosen
            self.inner.step()
        finally:
            for group, original in zip(self.inner.param_groups, saved):
                group["params"] = original
        states: list[dict[str, Any] | None] = []
        for piece, view in zip(sub_group.pieces, pieces):
            if view is None:
                states.append(None)
                continue
            view.grad = None
            notify = self.held.get(params[piece.group][piece.position])
            if notify is not None:
                notify(piece.start, view)  # e.g. the new fp32 master cast into the bf16 parameters
            state = self.inner.state.pop(view, {})
            new_scalars[params[piece.group][piece.position]] = {
                k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
            states.append(state)
        return states

    def _pack(self, sub_group: SubGroup, buffer: torch.Tensor, states: list[dict[str, Any] | None]) -> None:
        """Copy each piece's per-element state into its place in `buffer` (a no-op where the
        optimizer updated the buffer's own views in place)."""
        assert self.kinds is not None
        for position, state in enumerate(states):
            if state is None:
                continue
            for kind, target in zip(self.kinds, self._views(sub_group, buffer, position).values()):
                value = state.get(kind.key)
                if not isinstance(value, torch.Tensor) or value.numel() != target.numel():
                    raise errors.OffloadError(f"optimizer state {kind.key!r} is not per-element here: only "
                                              "elementwise optimizer state can be swapped")
                if value.data_ptr() != target.data_ptr():
                    target.copy_(value.reshape(-1))

    # ------------------------------------------------------------------ layout of a sub-group file
    def _region_offsets(self, sub_group: SubGroup) -> list[int]:
        offsets, at = [], self._values_bytes(sub_group)
        for kind in self.kinds or ():
            offsets.append(at)
            at += -(-sub_group.numel * kind.itemsize // _REGION_ALIGN) * _REGION_ALIGN
        return offsets + [at]

    def _file_bytes(self, sub_group: SubGroup) -> int:
        return self._region_offsets(sub_group)[-1]

    def _views(self, sub_group: SubGroup, buffer: torch.Tensor, position: int) -> dict[str, torch.Tensor]:
        """Piece `position`'s state tensors, as views of a sub-group buffer."""
        assert self.kinds is not None
        start = sum(piece.length for piece in sub_group.pieces[:position])
        length = sub_group.pieces[position].length
        views = {}
        for kind, region in zip(self.kinds, self._region_offsets(sub_group)):
            low = region + start * kind.itemsize
            views[kind.key] = buffer[low: low + length * kind.itemsize].view(kind.dtype)
        return views

    def _allocate_buffers(self) -> None:
        if self.kinds or self.held:
            size = max(self._file_bytes(sg) for sg in self._plan)
            count = max(1, min(self.settings.buffer_count, len(self._plan)))  # never more buffers than sub-groups
            self._stream.allocate(size, count)

    def _check_plan(self) -> None:
        """Plan the sub-groups over the tensors the inner optimizer steps (once: they never change)."""
        key = tuple(id(t) for group in self.inner.param_groups for t in group["params"])
        if key == self._plan_key:
            return
        assert not self._plan_key, "a swapped optimizer's tensors cannot change"
        for group in self.inner.param_groups:
            for tensor in group["params"]:
                if tensor.device.type != "cpu" or tensor.dim() != 1:
                    raise errors.OffloadError("swap files hold the state of flat CPU tensors only (zerodist's "
                                              f"shards); got a {tensor.dim()}-d tensor on {tensor.device}")
        self._plan_key = key
        self._plan = plan_subgroups([[t.numel() for t in g["params"]] for g in self.inner.param_groups],
                                    self.settings.sub_group_size)

    # ------------------------------------------------------------------ state read back, state written
    def read_state(self, tensor: torch.Tensor) -> dict[str, Any]:
        """`tensor`'s whole state: its scalars and its per-element state read from the swap files."""
        if tensor not in self.scalars:
            raise KeyError("this tensor has no optimizer state yet")
        state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.scalars[tensor].items()}
        if not self.kinds or not self._on_disk:
            return state
        self._stream.drain(keep_reads=True)
        values = {kind.key: torch.empty(tensor.numel(), dtype=kind.dtype, device="cpu") for kind in self.kinds}
        for sub_group, position in self._pieces_of(tensor):
            piece = sub_group.pieces[position]
            start = sum(p.length for p in sub_group.pieces[:position])
            for kind, region in zip(self.kinds, self._region_offsets(sub_group)):
                out = values[kind.key][piece.start: piece.start + piece.length]
                self.directory.read(sub_group.index, out, offset=region + start * kind.itemsize, whole=False)
        state.update(values)
        return state

    def _pieces_of(self, tensor: torch.Tensor) -> Iterator[tuple[SubGroup, int]]:
        params = [group["params"] for group in self.inner.param_groups]
        for sub_group in self._plan:
            for position, piece in enumerate(sub_group.pieces):
                if params[piece.group][piece.position] is tensor:
                    yield sub_group, position

    def _absorb(self, loaded: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Write a loaded state to the swap files (a resume rebuilds them) and keep its scalars."""
        self.scalars = {t: {k: v for k, v in s.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
                        for t, s in loaded.items() if s}
        self.kinds = _kinds_of(list(loaded.values())) if loaded else None
        self._stream.drain()  # the files are rewritten: no write may land after, no read ahead stays
        self._allocate_buffers()
        self._on_disk = False
        if not self.kinds:
            return
        if len(self.scalars) != len(self._plan_key):
            raise errors.OffloadError("a swapped optimizer loads a state that covers every tensor or none")
        params = [group["params"] for group in self.inner.param_groups]
        buffer = self._host_buffers[0]
        for sub_group in self._plan:
            if self._values_bytes(sub_group):  # the held values stay what they are
                self.directory.read(sub_group.index, buffer[: self._values_bytes(sub_group, aligned=False)],
                                    whole=False)
            states: list[dict[str, Any] | None] = []
            for piece in sub_group.pieces:
                full = loaded[params[piece.group][piece.position]]
                states.append({k: v.reshape(-1)[piece.start: piece.start + piece.length] for k, v in full.items()
                               if isinstance(v, torch.Tensor) and v.dim() > 0})
            self._pack(sub_group, buffer, states)
            self.directory.write(sub_group.index, buffer[: self._file_bytes(sub_group)])
        self._on_disk = True

    # ------------------------------------------------------------------ waiting and agreeing
    def _agree(self, failure: Exception | None) -> None:
        """Every rank raises when any rank's swap I/O failed ([Note: failures agreed])."""
        if not comm.is_initialized():  # one process without a process group (unit tests, tools)
            if failure is not None:
                raise failure
            return
        flag = torch.tensor([0.0 if failure is None else 1.0], device=comm.device_for_rank())
        comm.all_reduce(flag, group=self.group)
        if flag.item() == 0:
            return
        reports: list[Any] = [None] * comm.get_world_size(self.group)
        here = None if failure is None else (type(failure).__name__, str(failure))
        comm.all_gather_object(reports, here, group=self.group)
        if failure is not None:
            raise failure
        rank, (name, message) = next((r, report) for r, report in enumerate(reports) if report is not None)
        raise getattr(errors, name, errors.OffloadError)(f"on rank {rank}: {message}")


def _kinds_of(states: list[dict[str, Any] | None]) -> tuple[Kind, ...]:
    """The per-element state kinds, from the first state that has any (tensors of one or more dims)."""
    for state in states:
        if state:
            return tuple(Kind(k, v.dtype) for k, v in sorted(state.items())
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return ()
